//! One download per node: local rank 0 gets the data set (download, checks, extraction) while
//! the node's other workers wait for it on the filesystem, on a status file local rank 0 keeps
//! in the data folder, rather than at the group's barrier, whose collective timeout a slow
//! download outlasts.
//!
//! A data set already in the folder needs none of this: local rank 0 writes nothing (the folder
//! may be read-only), and the others go on as soon as they see it there.
//!
//! Local rank 0 rewrites the file every second while it works (so the others know it is alive:
//! its download's own stall timeout bounds a download that no longer progresses), then writes
//! how it ended: ready, or failed with its error, which the others report as theirs, naming
//! the download rather than blaming a silent peer. It removes the file once every rank has
//! passed the group's barrier. Each write replaces the file whole (temporary file, rename).

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{RecvTimeoutError, channel};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use collective::World;

use super::{DataProgress, Layout};
use crate::error::{IoContext, Result, TrainError};

/// How often local rank 0 says it is still at work.
const HEARTBEAT: Duration = Duration::from_secs(1);
/// How often a waiting rank reads the status.
const POLL: Duration = Duration::from_millis(100);
/// A waiting rank says what it waits for once it has waited this long.
const SAY_AFTER: Duration = Duration::from_secs(1);
/// A status written this long before a rank began to wait was left by an earlier run (whose
/// local rank 0 was killed before it could remove it).
const STALE: Duration = Duration::from_secs(5);

/// A node's data set, got by its local rank 0 for all its workers.
pub struct Handoff {
    dir: PathBuf,
    /// `None` when this worker is its node's only one: nobody waits.
    status: Option<PathBuf>,
    /// The rank of the node's local rank 0.
    leader: u32,
    leads: bool,
    /// Silence of local rank 0 after which a waiting rank gives up on it.
    patience: Duration,
}

/// What local rank 0 says: the first line is the state and when it was written (Unix
/// milliseconds), the rest a failure's message.
#[derive(Debug, PartialEq, Eq)]
enum Status {
    Working,
    Ready,
    Failed(String),
}

impl Handoff {
    /// The handoff of the node of `world` for the data set in `dir`.
    pub fn new(dir: &Path, world: &World) -> Handoff {
        let leader = world.rank.saturating_sub(world.local_rank);
        let run: String = world
            .run_id
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        Handoff {
            dir: dir.to_path_buf(),
            status: (world.local_world_size > 1).then(|| {
                dir.join(format!(
                    ".trainctl-data.{run}.{}.{leader}",
                    world.restart_count
                ))
            }),
            leader,
            leads: world.local_rank == 0,
            patience: Duration::from_secs(30),
        }
    }

    /// Local rank 0: runs `work` (getting the data set), telling the node's other workers it is
    /// at work while it runs and how it ended. Returns what `work` returned.
    pub fn lead(&self, work: impl FnOnce() -> Result<()>) -> Result<()> {
        let Some(status) = self.status.as_deref() else {
            return work();
        };
        if Layout::locate(&self.dir).is_some() {
            return work();
        }
        std::fs::create_dir_all(&self.dir).at(&self.dir)?;
        write(status, &Status::Working)?;
        let (stop, stopped) = channel::<()>();
        let result = std::thread::scope(|scope| {
            scope.spawn(move || {
                while let Err(RecvTimeoutError::Timeout) = stopped.recv_timeout(HEARTBEAT) {
                    // A failed write shows as silence, which the others report.
                    let _ = write(status, &Status::Working);
                }
            });
            let result = work();
            drop(stop);
            result
        });
        match &result {
            Ok(()) => write(status, &Status::Ready)?,
            // Its own error is the one to report; the others give up on its silence.
            Err(e) => {
                let _ = write(status, &Status::Failed(e.to_string()));
            }
        }
        result
    }

    /// The node's other workers: waits until local rank 0 has got the data set (`Ok(Ok(()))`)
    /// or failed (`Ok(Err(_))`, naming what failed: the caller still passes the group's
    /// barrier with it, so that local rank 0 can clean up). `Err` is this worker's own end: it
    /// was asked to stop, or local rank 0 went silent.
    pub fn wait(
        &self,
        stop: &AtomicBool,
        progress: &mut dyn FnMut(DataProgress),
    ) -> Result<Result<()>> {
        let Some(status) = self.status.as_deref() else {
            return Ok(Ok(()));
        };
        let began = Instant::now();
        let fresh_after = SystemTime::now() - STALE;
        let mut said = false;
        // The last status read, and when it changed.
        let (mut last, mut changed) = (None, Instant::now());
        loop {
            let read = read(status, fresh_after);
            match &read {
                Some((Status::Ready, _)) => return Ok(Ok(())),
                Some((Status::Failed(problem), _)) => {
                    return Ok(Err(TrainError::NodeData {
                        leader: self.leader,
                        problem: format!("failed: {problem}"),
                    }));
                }
                // There already, or put there by another node sharing the folder.
                _ if Layout::locate(&self.dir).is_some() => return Ok(Ok(())),
                _ => {}
            }
            let seen = read.map(|(_, written)| written);
            if seen != last {
                (last, changed) = (seen, Instant::now());
            } else if changed.elapsed() >= self.patience {
                return Err(TrainError::NodeData {
                    leader: self.leader,
                    problem: format!(
                        "has not said how it goes ({} not rewritten) for {} s: it hung or died; its own lines say more",
                        status.display(),
                        super::download::seconds(self.patience)
                    ),
                });
            }
            if stop.load(Ordering::Relaxed) {
                return Err(TrainError::Stopped(format!(
                    "while waiting for rank {} (local rank 0) to get the data set into {}; this worker had trained nothing",
                    self.leader,
                    self.dir.display()
                )));
            }
            if !said && began.elapsed() >= SAY_AFTER {
                progress(DataProgress::Waiting { rank: self.leader });
                said = true;
            }
            std::thread::sleep(POLL);
        }
    }
}

impl Drop for Handoff {
    /// Local rank 0 removes the status once the others have read it (after the group's
    /// barrier, or when they are gone).
    fn drop(&mut self) {
        if let (true, Some(status)) = (self.leads, &self.status) {
            let _ = std::fs::remove_file(status);
        }
    }
}

fn write(path: &Path, status: &Status) -> Result<()> {
    let millis = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis();
    let text = match status {
        Status::Working => format!("working {millis}\n"),
        Status::Ready => format!("ready {millis}\n"),
        Status::Failed(problem) => format!("failed {millis}\n{problem}"),
    };
    let mut temporary = path.as_os_str().to_owned();
    temporary.push(".tmp");
    let temporary = PathBuf::from(temporary);
    std::fs::write(&temporary, text).at(&temporary)?;
    std::fs::rename(&temporary, path).at(path)
}

/// The status at `path` and when it was written, unless it is missing, unreadable or older
/// than `fresh_after`.
fn read(path: &Path, fresh_after: SystemTime) -> Option<(Status, u128)> {
    let text = std::fs::read_to_string(path).ok()?;
    let (first, rest) = text.split_once('\n')?;
    let (state, millis) = first.split_once(' ')?;
    let millis: u128 = millis.parse().ok()?;
    let fresh_after = fresh_after
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis();
    if millis < fresh_after {
        return None;
    }
    let status = match state {
        "working" => Status::Working,
        "ready" => Status::Ready,
        "failed" => Status::Failed(rest.to_string()),
        _ => return None,
    };
    Some((status, millis))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn world(rank: u32, local_world_size: u32) -> World {
        World {
            local_rank: rank % local_world_size,
            local_world_size,
            ..World::loopback(rank, 2 * local_world_size, 0, "run/1")
        }
    }

    /// Local rank 0's work outlasts the waiting rank's patience several times over: its
    /// heartbeat keeps the other waiting, and the other says what it waits for.
    #[test]
    fn the_others_wait_as_long_as_local_rank_0_works_and_say_so() {
        let dir = tempfile::tempdir().unwrap();
        let data = dir.path().join("data");
        let stop = AtomicBool::new(false);
        let leader = Handoff::new(&data, &world(2, 2));
        let mut waiter = Handoff::new(&data, &world(3, 2));
        waiter.patience = HEARTBEAT * 2;
        let (said, heard) = channel();
        let (waited, told) = std::thread::scope(|s| {
            let (waiter, stop) = (&waiter, &stop);
            let waiting = s.spawn(move || {
                let mut told = Vec::new();
                let waited = waiter.wait(stop, &mut |p| {
                    told.push(p);
                    let _ = said.send(());
                });
                (waited, told)
            });
            leader
                .lead(|| {
                    heard
                        .recv_timeout(Duration::from_secs(20))
                        .expect("the waiting rank says what it waits for");
                    // A slow download: three times the waiting rank's patience.
                    let (_never, slow) = channel::<()>();
                    let _ = slow.recv_timeout(waiter.patience * 3);
                    std::fs::create_dir_all(data.join("cifar-10-batches-bin")).unwrap();
                    Ok(())
                })
                .unwrap();
            waiting.join().unwrap()
        });
        assert!(matches!(waited, Ok(Ok(()))), "{waited:?}");
        assert_eq!(told, [DataProgress::Waiting { rank: 2 }]);
        drop(leader);
        let left: Vec<_> = std::fs::read_dir(&data).unwrap().flatten().collect();
        assert_eq!(left.len(), 1, "only the data set is left: {left:?}");
    }

    #[test]
    fn a_failure_reaches_the_others_with_its_message() {
        let dir = tempfile::tempdir().unwrap();
        let stop = AtomicBool::new(false);
        let (leader, waiter) = (
            Handoff::new(dir.path(), &world(0, 2)),
            Handoff::new(dir.path(), &world(1, 2)),
        );
        let led = leader.lead(|| {
            Err(TrainError::Download {
                url: "http://mirror/c.tgz".into(),
                problem: "no data from http://mirror/c.tgz for 60 s".into(),
            })
        });
        assert!(matches!(led, Err(TrainError::Download { .. })));
        let waited = waiter.wait(&stop, &mut |_| {}).unwrap();
        let message = waited.unwrap_err().to_string();
        assert!(
            message.contains("rank 0")
                && message.contains("download of http://mirror/c.tgz failed: no data from"),
            "{message}"
        );
    }

    #[test]
    fn a_status_left_by_an_earlier_run_is_not_believed() {
        let dir = tempfile::tempdir().unwrap();
        let stop = AtomicBool::new(false);
        let mut waiter = Handoff::new(dir.path(), &world(1, 2));
        waiter.patience = Duration::from_millis(300);
        let path = waiter.status.clone().unwrap();
        std::fs::write(&path, "failed 1000\nan old failure").unwrap();
        let waited = waiter.wait(&stop, &mut |_| {});
        let message = waited.unwrap_err().to_string();
        assert!(message.contains("hung or died"), "{message}");
        assert!(!message.contains("an old failure"), "{message}");
    }

    #[test]
    fn a_waiting_rank_asked_to_stop_stops() {
        let dir = tempfile::tempdir().unwrap();
        let stop = AtomicBool::new(true);
        let waiter = Handoff::new(dir.path(), &world(1, 2));
        let waited = waiter.wait(&stop, &mut |_| {});
        assert!(matches!(waited, Err(TrainError::Stopped(_))), "{waited:?}");
    }

    #[test]
    fn a_data_set_already_there_needs_no_status() {
        let dir = tempfile::tempdir().unwrap();
        crate::data::synthetic::write_binary(
            dir.path(),
            &crate::data::synthetic::cifar(10, 1),
            &crate::data::synthetic::cifar(10, 2),
        )
        .unwrap();
        let before = std::fs::read_dir(dir.path()).unwrap().count();
        let stop = AtomicBool::new(false);
        let (leader, waiter) = (
            Handoff::new(dir.path(), &world(0, 2)),
            Handoff::new(dir.path(), &world(1, 2)),
        );
        // The waiting rank first: it finds the data set without a word from local rank 0.
        let mut told = Vec::new();
        assert!(matches!(
            waiter.wait(&stop, &mut |p| told.push(p)),
            Ok(Ok(()))
        ));
        assert!(told.is_empty(), "{told:?}");
        leader.lead(|| Ok(())).unwrap();
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), before);
    }

    #[test]
    fn a_node_of_one_worker_writes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let alone = Handoff::new(dir.path(), &world(0, 1));
        alone.lead(|| Ok(())).unwrap();
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
    }
}
