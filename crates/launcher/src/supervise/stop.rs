//! Stopping a group: on request, after a failure (the root cause: the earliest failure a
//! worker recorded), or when it hangs (every worker's stack taken first).

use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime};

use super::{Group, Trouble, recorded, stop_all};
use crate::report::{ExitKind, Failure, Stuck};
use crate::stacks;

impl Group {
    /// Stops the group for `trouble`; returns the root cause.
    pub(crate) fn stop_troubled(&mut self, grace: Duration, trouble: Trouble) -> Failure {
        match trouble {
            Trouble::Failed(f) => self.stop_failed(grace, *f),
            Trouble::Hung(silent) => self.stop_hung(grace, silent, ExitKind::Hung(silent)),
            Trouble::Unanswered(waited) => {
                self.stop_hung(grace, waited, ExitKind::Unanswered(waited))
            }
        }
    }

    /// A hang: every running worker's stack is taken (and written whole beside the logs) before
    /// the group is stopped. The report names where each was; the rank it leads with is one
    /// that is not waiting in a collective, when there is one (the others wait for it).
    fn stop_hung(&mut self, grace: Duration, silent: Duration, exit: ExitKind) -> Failure {
        let seen_running = self.last_poll;
        let dumps: Vec<(u32, u32, stacks::Dump)> = self
            .workers
            .iter_mut()
            .filter_map(|w| w.poll(seen_running).is_none().then_some(w))
            .map(|w| (w.rank, w.child.id(), stacks::dump(w.child.id())))
            .collect();
        let stacks_file = self.write_stacks(silent, &dumps);
        let stuck: Vec<Stuck> = dumps
            .iter()
            .map(|(rank, pid, d)| Stuck {
                rank: *rank,
                pid: *pid,
                at: d.innermost(),
            })
            .collect();
        let lead = stuck
            .iter()
            .find(|s| !stacks::in_collective(&s.at))
            .or(stuck.first())
            .map(|s| (s.rank, s.pid));
        // Every worker may have exited since the poll: then the report leads with the first.
        let (rank, pid) = lead
            .or_else(|| self.workers.first().map(|w| (w.rank, w.child.id())))
            .unwrap_or_default();
        let worker = self.workers.iter().find(|w| w.rank == rank);
        let failure = Failure {
            rank,
            local_rank: worker.map_or(0, |w| w.local_rank),
            node_rank: self.node_rank,
            pid,
            exit,
            after: self.start.elapsed(),
            at: SystemTime::now() - silent,
            restart_count: self.restart_count,
            error: None,
            error_file_problem: None,
            stderr_tail: Vec::new(),
            log_file: worker.and_then(|w| w.stderr_log.clone()),
            stuck,
            stacks_file,
            timer: None,
        };
        self.halt(grace);
        failure
    }

    /// Every dump, whole, in `stacks.txt` of the attempt's log folder (or a file beside the
    /// scratch folder, kept): the report has only the innermost frames.
    fn write_stacks(
        &self,
        silent: Duration,
        dumps: &[(u32, u32, stacks::Dump)],
    ) -> Option<PathBuf> {
        let path = match (&self.logs, &self.scratch) {
            (Some(dir), _) => dir.join("stacks.txt"),
            // Beside the scratch folder, which goes with the group (a run id may hold dots, so
            // the name is extended, not its extension replaced).
            (None, Some(scratch)) => {
                let mut name = scratch.file_name()?.to_os_string();
                name.push(".stacks.txt");
                scratch.with_file_name(name)
            }
            (None, None) => return None,
        };
        let mut text = format!(
            "no line of output or CPU time for {:.1} s; the stacks of node {}'s workers:\n",
            silent.as_secs_f64(),
            self.node_rank
        );
        for (rank, _, dump) in dumps {
            text.push_str(&format!("\nrank {rank}: {dump}"));
        }
        std::fs::write(&path, text).ok().map(|()| path)
    }

    /// Stops every worker still running and collects their output.
    pub(crate) fn stop(mut self, grace: Duration) {
        self.halt(grace);
    }

    /// [`Group::stop`] because the launcher was told to stop; whether a worker saved a checkpoint
    /// on its way out (it exited with `contract::exit::PREEMPTED`).
    pub(crate) fn stop_interrupted(mut self, grace: Duration) -> bool {
        self.halt(grace);
        self.workers
            .iter()
            .any(|w| w.exited == Some(ExitKind::Code(contract::exit::PREEMPTED)))
    }

    /// [`Group::stop`] after `failure`, the first failure this launcher saw; returns the root
    /// cause. That is the earliest failure: what a worker's `@record` wrote, by when it wrote it
    /// (even if that worker was still cleaning up when another exited), or the failure seen.
    /// The report gets the worker's error file, or its last lines of stderr.
    pub(crate) fn stop_failed(&mut self, grace: Duration, failure: Failure) -> Failure {
        self.halt(grace);
        let mut root = failure;
        let mut root_recorded = None;
        for w in &self.workers {
            let Some(rec) = recorded(&w.error_file) else {
                continue;
            };
            let earlier = rec.at < root.at;
            if w.rank == root.rank || earlier {
                if w.rank != root.rank {
                    root = Failure {
                        rank: w.rank,
                        local_rank: w.local_rank,
                        pid: w.child.id(),
                        exit: w.exited.clone().unwrap_or(ExitKind::Code(-1)),
                        log_file: w.stderr_log.clone(),
                        ..root
                    };
                }
                root.at = rec.at;
                root_recorded = Some(rec);
            }
        }
        if let Some(rec) = root_recorded {
            root.after = rec.at.duration_since(self.start_wall).unwrap_or(root.after);
            match rec.error {
                Ok(e) => root.error = Some(e),
                Err(problem) => root.error_file_problem = Some(problem),
            }
        }
        if let Some(w) = self.workers.iter().find(|w| w.rank == root.rank) {
            root.stderr_tail = w
                .tail
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .cloned()
                .collect();
        }
        root
    }

    fn halt(&mut self, grace: Duration) {
        stop_all(&mut self.workers, grace);
        // Output pumps end when the pipes close; a grandchild that keeps a pipe open must not
        // hold the launcher, so wait for them only briefly.
        let deadline = Instant::now() + Duration::from_secs(2);
        for w in self.workers.iter_mut() {
            for pump in std::mem::take(&mut w.pumps) {
                while !pump.is_finished() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(10));
                }
                if pump.is_finished() {
                    let _ = pump.join();
                }
            }
        }
    }
}
