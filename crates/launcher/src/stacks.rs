//! Where a hung worker is: its Python stacks read from outside with py-spy's library (the
//! launcher is the workers' parent, which Linux's ptrace rules let read a child's memory
//! without extra capabilities), or, for a program that is not Python, each thread's place in
//! the kernel from /proc (`wchan`, and the kernel stack where it can be read).

use std::path::Path;

/// One thread of a worker and its frames, innermost first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Thread {
    pub name: String,
    pub frames: Vec<String>,
}

/// A worker's stacks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Dump {
    /// The process read (the worker, or a Python process in its process group).
    pub pid: u32,
    /// Whether these are Python stacks.
    pub python: bool,
    pub threads: Vec<Thread>,
    /// Why the Python stacks could not be read, when they could not.
    pub problem: Option<String>,
}

/// Frames of the report's one line for a worker.
pub(crate) const WHERE_FRAMES: usize = 3;

/// A frame in Python's own library (`threading.py` under `Event.wait`): where a program
/// waits, but not what it waits in.
fn in_standard_library(frame: &str) -> bool {
    frame.contains("/lib/python3")
        && !frame.contains("site-packages")
        && !frame.contains("dist-packages")
}

impl Dump {
    /// Where the worker is, in one line: its main thread's innermost frames, Python's own
    /// library skipped (unless nothing else is there).
    pub fn innermost(&self) -> String {
        let main = self
            .threads
            .iter()
            .find(|t| t.name == "MainThread")
            .or_else(|| self.threads.first());
        let Some(frames) = main.map(|t| &t.frames).filter(|f| !f.is_empty()) else {
            return "(no stack could be read)".into();
        };
        let own: Vec<&String> = frames.iter().filter(|f| !in_standard_library(f)).collect();
        let shown: Vec<&String> = if own.is_empty() {
            frames.iter().collect()
        } else {
            own
        };
        shown
            .into_iter()
            .take(WHERE_FRAMES)
            .cloned()
            .collect::<Vec<_>>()
            .join(" < ")
    }
}

impl std::fmt::Display for Dump {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = if self.python { "Python" } else { "native" };
        writeln!(f, "process {} ({kind} stacks, innermost first)", self.pid)?;
        if let Some(problem) = &self.problem {
            writeln!(f, "  python stacks unavailable: {problem}")?;
        }
        for t in &self.threads {
            writeln!(f, "  thread {}", t.name)?;
            for frame in &t.frames {
                writeln!(f, "    {frame}")?;
            }
        }
        Ok(())
    }
}

/// The stacks of worker `pid` (the leader of its own process group): Python stacks of the
/// worker or, when it runs Python as a child (`sh -c python ...`), of the first Python process
/// in its group; else every thread's native place.
pub fn dump(pid: u32) -> Dump {
    let mut problem = None;
    for candidate in std::iter::once(pid).chain(group_members(pid)) {
        match python_stacks(candidate) {
            Ok(threads) => {
                return Dump {
                    pid: candidate,
                    python: true,
                    threads,
                    problem: None,
                };
            }
            Err(e) if candidate == pid => problem = Some(e),
            Err(_) => {}
        }
    }
    Dump {
        pid,
        python: false,
        threads: native_threads(pid),
        problem,
    }
}

fn python_stacks(pid: u32) -> Result<Vec<Thread>, String> {
    let config = py_spy::Config {
        include_idle: true,
        ..py_spy::Config::default()
    };
    let mut spy =
        py_spy::PythonSpy::new(pid as py_spy::Pid, &config).map_err(|e| format!("{e:#}"))?;
    let traces = spy.get_stack_traces().map_err(|e| format!("{e:#}"))?;
    Ok(traces
        .into_iter()
        .map(|t| Thread {
            name: t
                .thread_name
                .clone()
                .unwrap_or_else(|| format!("{:#x}", t.thread_id)),
            frames: t
                .frames
                .iter()
                .map(|fr| {
                    let code = source_line(&fr.filename, fr.line)
                        .map(|c| format!(": {c}"))
                        .unwrap_or_default();
                    format!("{}:{} in {}{code}", fr.filename, fr.line, fr.name)
                })
                .collect(),
        })
        .collect())
}

/// Whether a worker's one-line place ([`Dump::innermost`]) is a wait in a collective (it waits
/// for the others). DDP's backward is one: the autograd engine (`_engine_run_backward`, in C++
/// below it) runs the reducer's hooks, whose gradient all-reduce waits for every rank.
pub(crate) fn in_collective(at: &str) -> bool {
    at.split(" < ").any(|frame| {
        frame.contains("torch/distributed/")
            || (frame.contains("torch/autograd/") && frame.contains(" in _engine_run_backward"))
            || [
                "all_reduce",
                "all_gather",
                "reduce_scatter",
                "broadcast",
                "barrier",
                "all_to_all",
            ]
            .iter()
            .any(|op| frame.contains(&format!(" in {op}")))
    })
}

/// Line `line` of `file`, trimmed, when the file can be read (at most 4 MiB of it).
fn source_line(file: &str, line: i32) -> Option<String> {
    use std::io::{BufRead, Read};
    let n = usize::try_from(line).ok()?.checked_sub(1)?;
    let f = std::fs::File::open(file).ok()?;
    let text = std::io::BufReader::new(f.take(4 << 20))
        .lines()
        .nth(n)?
        .ok()?;
    let text = text.trim();
    (!text.is_empty()).then(|| text.chars().take(160).collect())
}

/// The other processes of process group `pgid` (a worker's children and theirs).
fn group_members(pgid: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut members: Vec<u32> = dir
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&pid| pid != pgid && process_group(pid) == Some(pgid))
        .collect();
    members.sort_unstable();
    members
}

/// The process group of `pid`, from /proc/PID/stat (fields after the command's closing paren).
pub(crate) fn process_group(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(2)?.parse().ok()
}

/// The state letter of a /proc `stat` line (after the command's closing paren).
fn thread_state(stat: &str) -> Option<char> {
    stat[stat.rfind(')')? + 1..].trim_start().chars().next()
}

/// Every thread of `pid` and where it waits in the kernel: `wchan`, and the kernel stack when
/// /proc lets it be read (root).
fn native_threads(pid: u32) -> Vec<Thread> {
    let task = format!("/proc/{pid}/task");
    let Ok(dir) = std::fs::read_dir(&task) else {
        return Vec::new();
    };
    let mut tids: Vec<u32> = dir
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect();
    tids.sort_unstable();
    tids.into_iter()
        .map(|tid| {
            let at = Path::new(&task).join(tid.to_string());
            let read = |name: &str| {
                std::fs::read_to_string(at.join(name))
                    .map(|s| s.trim().to_string())
                    .unwrap_or_default()
            };
            // The kernel stack (root only), innermost first: "wait_woken+0x89/0x90" is shown
            // as "kernel: wait_woken"; else the one function it waits in.
            let mut frames: Vec<String> = read("stack")
                .lines()
                .filter_map(|l| l.split_whitespace().last())
                .map(|f| format!("kernel: {}", f.split('+').next().unwrap_or(f)))
                .collect();
            let wchan = read("wchan");
            if frames.is_empty() && !wchan.is_empty() && wchan != "0" {
                frames.push(format!("kernel: waiting in {wchan}"));
            }
            // A thread on a CPU has no place in the kernel: say so rather than nothing.
            if frames.is_empty() && thread_state(&read("stat")) == Some('R') {
                frames.push("running on a CPU (not waiting in the kernel)".into());
            }
            Thread {
                name: format!("{} (tid {tid})", read("comm")),
                frames,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_native_program_is_described_by_its_threads() {
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        let pid = child.id();
        // /proc shows the child as soon as it exists; its name once it has exec'd.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let dump = loop {
            let d = dump(pid);
            if d.threads.iter().any(|t| t.name.starts_with("sleep"))
                || std::time::Instant::now() > deadline
            {
                break d;
            }
            std::thread::yield_now();
        };
        let _ = child.kill();
        let _ = child.wait();
        assert!(!dump.python, "{dump}");
        assert!(dump.problem.is_some(), "why Python was not read: {dump}");
        assert_eq!(dump.threads.len(), 1, "{dump}");
        assert!(dump.threads[0].name.starts_with("sleep (tid "), "{dump}");
    }

    /// A child's Python stack, read from outside while it sleeps (the launcher's position: its
    /// parent), with the source line of each frame.
    #[test]
    fn a_python_childs_stack_is_read_from_outside() {
        let dir = tempfile::tempdir().unwrap();
        let script = dir.path().join("snooze.py");
        std::fs::write(
            &script,
            "import sys, time\n\ndef snooze():\n    print('ready', flush=True)\n    time.sleep(30)\n\nsnooze()\n",
        )
        .unwrap();
        let mut child = std::process::Command::new("python3")
            .arg(&script)
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        std::io::BufRead::read_line(
            &mut std::io::BufReader::new(child.stdout.take().unwrap()),
            &mut line,
        )
        .unwrap();
        assert_eq!(line, "ready\n");
        let d = dump(child.id());
        let _ = child.kill();
        let _ = child.wait();
        assert!(d.python, "{d}");
        let at = format!("{}:5 in snooze: time.sleep(30)", script.display());
        assert!(d.innermost().starts_with(&at), "{d}");
        assert!(d.to_string().contains(":7 in <module>: snooze()"), "{d}");
    }

    #[test]
    fn a_busy_native_thread_is_said_to_be_running() {
        assert_eq!(thread_state("42 (trainctl) R 1 42 42 0"), Some('R'));
        assert_eq!(thread_state("42 (a b) c) S 1"), Some('S'));
        assert_eq!(thread_state("garbage"), None);
        let mut child = std::process::Command::new("sh")
            .args(["-c", "while :; do :; done"])
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        let running = loop {
            let d = dump(child.id());
            let busy = d
                .threads
                .iter()
                .any(|t| t.frames == ["running on a CPU (not waiting in the kernel)"]);
            if busy || std::time::Instant::now() > deadline {
                break busy;
            }
            std::thread::yield_now();
        };
        let _ = child.kill();
        let _ = child.wait();
        assert!(running, "a spinning shell is seen running");
    }

    #[test]
    fn the_innermost_frames_are_one_line() {
        let d = Dump {
            pid: 1,
            python: true,
            threads: vec![
                Thread {
                    name: "Thread-1".into(),
                    frames: vec!["x.py:1 in f".into()],
                },
                Thread {
                    name: "MainThread".into(),
                    frames: (1..=5).map(|i| format!("m.py:{i} in g{i}")).collect(),
                },
            ],
            problem: None,
        };
        assert_eq!(d.innermost(), "m.py:1 in g1 < m.py:2 in g2 < m.py:3 in g3");
        let waiting = Dump {
            threads: vec![Thread {
                name: "MainThread".into(),
                frames: vec![
                    "/usr/lib/python3.11/threading.py:327 in Condition.wait: waiter.acquire()"
                        .into(),
                    "/job/a.py:9 in all_reduce: done.wait()".into(),
                    "/venv/lib/python3.11/site-packages/x.py:2 in f".into(),
                ],
            }],
            ..d
        };
        assert_eq!(
            waiting.innermost(),
            "/job/a.py:9 in all_reduce: done.wait() < /venv/lib/python3.11/site-packages/x.py:2 in f"
        );
    }

    #[test]
    fn ddp_backward_is_a_collective_wait_and_a_sleep_is_not() {
        let ddp = "/venv/lib/python3.11/site-packages/torch/autograd/graph.py:1113 in _engine_run_backward: return Variable._execution_engine.run_backward( < /venv/lib/python3.11/site-packages/torch/autograd/__init__.py:347 in backward < /venv/lib/python3.11/site-packages/torch/_tensor.py:648 in backward";
        assert!(in_collective(ddp));
        assert!(in_collective(
            "/venv/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py:2501 in all_reduce"
        ));
        assert!(!in_collective("/job/train.py:40 in main: time.sleep(3600)"));
        // A user's own function named like the engine's, outside torch, is not the engine.
        assert!(!in_collective("/job/mine.py:3 in _engine_run_backward"));
    }
}
