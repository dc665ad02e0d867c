//! Whether a node's workers are working, by the CPU time of their process groups (each worker
//! and what it started: DataLoader workers, a shell's program). `--hang-timeout` counts from
//! the last sign of progress, a line of output or CPU time: a start (importing torch, loading
//! a model) uses a core and is not a hang however silent, while a wait in a collective or a
//! sleep uses none and is one, however early.

use std::time::{Duration, Instant};

/// How often the workers' CPU time is read (a pass over /proc).
const WINDOW: Duration = Duration::from_secs(1);

/// The share of one core the workers must use over a window to count as working: what a
/// program blocked in a collective spends (gloo's and NCCL's threads polling, the
/// interpreter's ticks) stays well under it.
const BUSY: f64 = 0.1;

/// The CPU time of a set of process groups, sampled every [`WINDOW`].
pub(crate) struct CpuClock {
    groups: Vec<i32>,
    /// The last sample: when, and the groups' CPU time then (clock ticks).
    mark: Option<(Instant, u64)>,
    last_busy: Instant,
    ticks_per_s: f64,
}

impl CpuClock {
    /// A clock for the workers whose process groups are `groups`, busy as of now (they start).
    pub(crate) fn new(groups: Vec<i32>) -> Self {
        let ticks_per_s = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
            .ok()
            .flatten()
            .map_or(100.0, |t| t as f64);
        CpuClock {
            groups,
            mark: None,
            last_busy: Instant::now(),
            ticks_per_s,
        }
    }

    /// Reads the groups' CPU time when a window has passed since the last reading.
    pub(crate) fn sample(&mut self) {
        let now = Instant::now();
        if self.mark.is_some_and(|(at, _)| now - at < WINDOW) {
            return;
        }
        let ticks = group_ticks(&self.groups);
        if let Some((at, before)) = self.mark {
            let used = ticks.saturating_sub(before) as f64 / self.ticks_per_s;
            if busy(used, now - at) {
                self.last_busy = now;
            }
        }
        self.mark = Some((now, ticks));
    }

    /// How long since the workers last used the CPU as working processes do.
    pub(crate) fn idle_for(&self) -> Duration {
        self.last_busy.elapsed()
    }
}

/// Whether `used` seconds of CPU over `window` is working.
fn busy(used: f64, window: Duration) -> bool {
    used >= BUSY * window.as_secs_f64()
}

/// The CPU time (user and system, clock ticks) of every process in `groups`, from /proc.
fn group_ticks(groups: &[i32]) -> u64 {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return 0;
    };
    let mut total = 0u64;
    for entry in entries.flatten() {
        let name = entry.file_name();
        if !name.to_string_lossy().bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
            continue;
        };
        if let Some((group, ticks)) = parse_stat(&stat)
            && groups.contains(&group)
        {
            total = total.saturating_add(ticks);
        }
    }
    total
}

/// A /proc/PID/stat line's process group and CPU ticks (utime + stime). The command name, in
/// parentheses, may hold spaces and parentheses: the fields are counted after its last `)`.
fn parse_stat(stat: &str) -> Option<(i32, u64)> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt utime stime
    let group = fields.get(2)?.parse().ok()?;
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some((group, utime.saturating_add(stime)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stat_line_with_a_strange_name_is_read_after_its_last_parenthesis() {
        let stat = "4242 (py (thon) x) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 30 0 0 20 0 3";
        assert_eq!(parse_stat(stat), Some((4242, 280)));
        assert_eq!(parse_stat("garbage"), None);
        assert_eq!(parse_stat("1 (x) S 1"), None);
    }

    #[test]
    fn working_is_a_tenth_of_a_core_or_more() {
        let second = Duration::from_secs(1);
        assert!(busy(0.5, second));
        assert!(busy(0.1, second));
        assert!(!busy(0.02, second), "a wait's polling threads");
    }

    #[test]
    fn this_process_working_shows_and_a_sleep_does_not() {
        let me = nix::unistd::getpgrp().as_raw();
        let before = group_ticks(&[me]);
        let start = Instant::now();
        let mut x = 0u64;
        while start.elapsed() < Duration::from_millis(300) {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
        }
        assert!(group_ticks(&[me]) > before, "300 ms of work shows ({x})");
        assert_eq!(group_ticks(&[-1]), 0, "no such group");
    }
}
