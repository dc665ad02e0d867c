//! Going on in a new group without restarting: when a peer is lost, or when the agent hands the
//! next round because a node joins, the worker leaves its group holding the last step it
//! completed, tells its agent over the control channel ([`collective::control`]), waits for the
//! next round's membership, joins the new group and takes the state of its most advanced rank
//! ([`sync`]). The epoch goes on from the position all ranks then hold, re-sharded over the
//! new world; nothing is read from a checkpoint and no process starts.
//!
//! Invariant: the collectives of a group's start are the same for a worker that has just
//! started and one that regroups (join, the data barrier, [`sync`]), so both can be in the same
//! new group.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::{Duration, Instant};

use collective::control::{Channel, ControlError, Regrouped, ToAgent, ToWorker};
use collective::regroup::{self as protocol, Waiting};
use collective::{CollectiveError, Interrupter, ProcessGroup, World};

use super::state::TrainState;
use super::{Event, Run, TrainConfig};
use crate::error::{Result, TrainError};

/// Why a worker leaves its group.
pub(super) enum Leave {
    /// A collective failed: a peer is gone.
    Lost(String),
    /// The agent handed the next round (a node joins or leaves) and every rank stopped after
    /// the same step. `saver` is the rank (of the group left) that checkpoints if a stop comes
    /// before the next round: rank 0, or the lowest rank that stays when rank 0's node leaves.
    Paused { saver: usize },
    /// This worker's node was asked to go: it leaves the job after the step all ranks paused
    /// at, and the others regroup without it.
    Going,
}

/// What a worker that left its group does next.
enum Next {
    /// Join the next round's group: its worker environment.
    Round(Vec<(String, String)>),
    /// A stop was asked for.
    Stop,
    /// Its node was asked to go.
    Leave,
}

/// The worker's end of the control channel. A thread reads the agent's messages as they come,
/// so that an [`ToWorker::Abort`] breaks the group's links even while the worker waits inside
/// a collective; the rest is handed to the training loop between steps.
pub(super) struct Control {
    channel: Channel,
    inbox: mpsc::Receiver<Result<ToWorker, ControlError>>,
    /// The current group's links, for an abort to break.
    links: Arc<Mutex<Option<Interrupter>>>,
    /// An assignment that came while the worker trained, for when it has left its group
    /// (after the step under way).
    assigned: Option<Vec<(String, String)>>,
    /// Assignments received, for the agent to tell current reports from stale ones.
    assignments: u64,
    /// Which of them made the group this worker is in or starting (0: its first, from its
    /// start's environment): a loss is reported as that group's, so that a loss in a group the
    /// worker is already leaving for an assignment in hand is stale to the agent.
    joined: u64,
    /// The agent asked this worker to leave the job (its node goes).
    leaving: bool,
}

impl Control {
    /// The channel `world` names, announced ready (a warm worker says so once its data is read:
    /// [`Control::ready`]); `None` (the worker restarts as torchrun's do) when there is none or
    /// it cannot be used, which is reported.
    pub(super) fn open(world: &World, report: &mut dyn FnMut(Event)) -> Option<Control> {
        let fd = world.control_fd?;
        let links = Arc::new(Mutex::new(None));
        let opened = Channel::from_fd(fd)
            .and_then(|channel| {
                let reader = channel.try_clone()?;
                Ok((channel, reader))
            })
            .map_err(ControlError::from)
            .and_then(|(mut channel, reader)| {
                if !world.warm {
                    channel.send(&ToAgent::Ready)?;
                }
                let inbox = read_on_a_thread(reader, Arc::clone(&links))?;
                Ok((channel, inbox))
            });
        match opened {
            Ok((channel, inbox)) => Some(Control {
                channel,
                inbox,
                links,
                assigned: None,
                assignments: 0,
                joined: 0,
                leaving: false,
            }),
            Err(e) => {
                report(Event::Warning(format!(
                    "the agent's control channel (descriptor {fd}) cannot be used: {e}; a change of group restarts this worker"
                )));
                None
            }
        }
    }

    /// A worker whose first group broke up before it trained (`reason`) waits for the next
    /// round and returns its environment.
    pub(super) fn rejoin(
        &mut self,
        world: &World,
        reason: String,
        stop: &AtomicBool,
    ) -> Result<World> {
        match self.next_round(Some(&Leave::Lost(reason.clone())), 0, stop) {
            Ok(Next::Round(env)) => world_from(&env, world),
            Ok(Next::Stop) => Err(TrainError::Stopped(format!(
                "while waiting to join a group ({reason}); this worker had trained nothing"
            ))),
            Ok(Next::Leave) => Err(TrainError::Stopped(format!(
                "while waiting to join a group ({reason}): its node was asked to go; this worker had trained nothing"
            ))),
            Err(e) => Err(TrainError::Collective(CollectiveError::PeerLost(format!(
                "{reason}; the agent did not regroup this worker ({e})"
            )))),
        }
    }

    /// Tells the agent the worker trains in its new group (what its regroup cost), and which
    /// of its assignments that group is.
    pub(super) fn regrouped(&mut self, regrouped: Regrouped) {
        let regrouped = Regrouped {
            assignments: self.assignments,
            ..regrouped
        };
        // The agent's report of the regroup; training goes on without it.
        let _ = self.channel.send(&ToAgent::Regrouped(regrouped));
    }

    /// Tells the agent the ranks found this worker's node a straggler (`slow`), or no longer.
    pub(super) fn straggler(&mut self, slow: bool, report: String) {
        // The agent's to act on (or not); training goes on either way.
        let _ = self.channel.send(&ToAgent::Straggler { slow, report });
    }

    /// Tells the agent the job's training is over: a peer going from now on changes nothing
    /// for this worker, which exits next.
    pub(super) fn finished(&mut self) {
        // The agent's to know; the worker ends either way.
        let _ = self.channel.send(&ToAgent::Finished);
    }

    /// `group`'s links are the ones an abort breaks from now on.
    pub(super) fn watch(&mut self, group: &ProcessGroup) {
        *self.links.lock().unwrap_or_else(|p| p.into_inner()) = group.interrupter();
    }

    /// Whether the agent has handed the next round (checked before each step, without
    /// waiting): the worker then leaves its group after that step, as every rank does.
    pub(super) fn pause_requested(&mut self) -> bool {
        // A broken channel shows when the worker next needs it; until then training goes on.
        while let Ok(Ok(message)) = self.inbox.try_recv() {
            match message {
                // Done by the reader: the next collective fails.
                ToWorker::Abort => {}
                // The next round already: kept for when this worker leaves its group.
                ToWorker::Assign(env) => {
                    self.assigned = Some(env);
                    self.assignments += 1;
                }
                ToWorker::Leave => self.leaving = true,
            }
        }
        self.assigned.is_some()
    }

    /// Whether the agent asked this worker to leave the job (as of the last
    /// [`Control::pause_requested`]): it raises the pause and leaves after that step.
    pub(super) fn leaving(&self) -> bool {
        self.leaving
    }

    /// Tells the agent this warm worker is ready: its start is done, and it waits for a place.
    pub(super) fn ready(&mut self) -> Result<()> {
        self.channel.send(&ToAgent::Ready).map_err(|e| {
            TrainError::Collective(CollectiveError::PeerLost(format!(
                "a warm worker could not tell its agent it is ready ({e})"
            )))
        })
    }

    /// A worker started warm (its data read before its node had a place in the job) waits for
    /// its first round and returns its environment; it tells the agent nothing first (it said
    /// it is ready when the channel opened).
    pub(super) fn first_round(&mut self, world: &World, stop: &AtomicBool) -> Result<World> {
        match self.next_round(None, 0, stop) {
            Ok(Next::Round(env)) => world_from(&env, world),
            Ok(Next::Stop) => Err(TrainError::Stopped(
                "while it waited, warm, for a place in the job; this worker had trained nothing"
                    .into(),
            )),
            Ok(Next::Leave) => Err(TrainError::Stopped(
                "while it waited, warm, for a place in the job: its node was asked to go; this \
                 worker had trained nothing"
                    .into(),
            )),
            Err(e) => Err(TrainError::Collective(CollectiveError::PeerLost(format!(
                "a warm worker's agent did not hand it a place in the job ({e})"
            )))),
        }
    }

    /// Tells the agent why the worker left its group (holding global step `step`; none for a
    /// warm worker, which had no group), then waits for the next round's environment, a stop,
    /// or the agent's word that this node goes; an error when the agent closed the channel (it
    /// will start this node's workers again).
    fn next_round(
        &mut self,
        why: Option<&Leave>,
        step: u64,
        stop: &AtomicBool,
    ) -> Result<Next, ControlError> {
        *self.links.lock().unwrap_or_else(|p| p.into_inner()) = None;
        let assignments = self.assignments;
        if let Some(why) = why {
            self.channel.send(&match why {
                Leave::Lost(reason) => ToAgent::Lost {
                    assignments: self.joined,
                    step,
                    reason: reason.clone(),
                },
                Leave::Paused { .. } | Leave::Going => ToAgent::Paused { assignments, step },
            })?;
        }
        let mut assigned = self.assigned.take();
        loop {
            // Rounds that came and went while this worker was busy: only the latest can form.
            while let Ok(Ok(message)) = self.inbox.try_recv() {
                self.take(message, &mut assigned);
            }
            // An assignment in hand is joined even when a stop came too: the stop then rides
            // the new group's first step, and every rank stops together.
            match protocol::waiting(
                self.leaving,
                assigned.is_some(),
                stop.load(Ordering::Relaxed),
            ) {
                Waiting::Leave => return Ok(Next::Leave),
                Waiting::Join => {
                    if let Some(env) = assigned.take() {
                        self.joined = self.assignments;
                        return Ok(Next::Round(env));
                    }
                }
                Waiting::Stop => return Ok(Next::Stop),
                Waiting::Wait => {}
            }
            match self.inbox.recv_timeout(Duration::from_millis(100)) {
                Ok(Ok(message)) => self.take(message, &mut assigned),
                Ok(Err(e)) => return Err(e),
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => return Err(ControlError::Closed),
            }
        }
    }

    /// A message that came while the worker waits for its next round.
    fn take(&mut self, message: ToWorker, assigned: &mut Option<Vec<(String, String)>>) {
        match message {
            ToWorker::Assign(env) => {
                *assigned = Some(env);
                self.assignments += 1;
            }
            ToWorker::Leave => self.leaving = true,
            // Asked before the group broke up: this worker has already left it.
            ToWorker::Abort => {}
        }
    }
}

/// Reads the agent's messages into a queue; an abort also breaks the links in `links` at once.
/// Ends at the first error (the agent closed the channel), which it queues last.
fn read_on_a_thread(
    mut reader: Channel,
    links: Arc<Mutex<Option<Interrupter>>>,
) -> std::io::Result<mpsc::Receiver<Result<ToWorker, ControlError>>> {
    let (tx, rx) = mpsc::channel();
    std::thread::Builder::new()
        .name("control".into())
        .spawn(move || {
            loop {
                let message = match reader.recv::<ToWorker>(Duration::from_secs(3600)) {
                    Ok(None) => continue,
                    Ok(Some(m)) => m,
                    Err(e) => {
                        let _ = tx.send(Err(e));
                        return;
                    }
                };
                if message == ToWorker::Abort
                    && let Some(links) = &*links.lock().unwrap_or_else(|p| p.into_inner())
                {
                    links.interrupt();
                }
                if tx.send(Ok(message)).is_err() {
                    return;
                }
            }
        })?;
    Ok(rx)
}

/// The worker environment of a new round, `env` as the agent handed it; the descriptors the
/// worker inherited stay `old`'s.
fn world_from(env: &[(String, String)], old: &World) -> Result<World> {
    let world =
        World::from_lookup(|name| env.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()))
            .map_err(|e| TrainError::Config(format!("the agent's new round: {e}")))?;
    Ok(World {
        telemetry_fd: old.telemetry_fd,
        control_fd: old.control_fd,
        node_health: world.node_health.or(old.node_health),
        ..world
    })
}

/// How a group's ranks came to hold the same state.
pub(super) struct Synced {
    /// Rank 0 read a checkpoint (only when no rank held a live state).
    pub(super) resumed: bool,
    /// This rank received a live state from a peer (not the job start's broadcast).
    pub(super) received: bool,
    /// Bytes of live state broadcast from the rank that had it (0 when every rank had it, and
    /// at a job's start).
    pub(super) bytes: u64,
}

/// Makes every rank's state the same at a group's start. Ranks that hold a live state (`live`:
/// they trained in an earlier group) say which global step they hold; when one does, the
/// lowest rank of those furthest on streams its state (position, parameters, buffers,
/// momentum) to all, unless every rank already holds that step (then their states are the
/// same, by the bit-identity invariant). When none does, the job starts: rank 0's fresh or
/// resumed state goes to all, as at any start.
///
/// A rank whose state is being replaced loses `live` until the stream is whole: a stream cut
/// off half-way (the source lost) leaves a state that must never be offered again.
pub(super) fn sync(
    cfg: &TrainConfig,
    group: &mut ProcessGroup,
    state: &mut TrainState,
    live: &mut bool,
    report: &mut dyn FnMut(Event),
) -> Result<Synced> {
    let rank = group.rank();
    let held = group.all_gather_u64(if *live {
        state.progress.global_step + 1
    } else {
        0
    })?;
    let furthest = held.iter().copied().max().unwrap_or(0);
    let (source, resumed) = if furthest == 0 {
        let resumed = rank == 0 && state.resume(cfg, report)?;
        (0, resumed)
    } else if held.iter().all(|&h| h == furthest) {
        *live = true;
        return Ok(Synced {
            resumed: false,
            received: false,
            bytes: 0,
        });
    } else {
        let source = held.iter().position(|&h| h == furthest).unwrap_or(0);
        (source, false)
    };
    // Ranks at the source's step hold its very bytes: overwriting them changes nothing.
    if held[rank] != furthest {
        *live = false;
    }
    let mut header = state.header(resumed);
    group.broadcast_bytes(&mut header, source)?;
    let resumed = state.apply_header(&header);
    group.broadcast(state.params_mut(), source)?;
    group.broadcast(&mut state.buffers, source)?;
    // A fresh start's momentum is zeros everywhere already.
    let momentum = resumed || furthest > 0;
    if momentum {
        group.broadcast(&mut state.momentum, source)?;
    }
    let floats =
        state.param_count() + state.buffers.len() + if momentum { state.momentum.len() } else { 0 };
    *live = true;
    // A job's start is not a regroup: nobody's live state travelled.
    let from_peer = furthest > 0;
    Ok(Synced {
        resumed,
        received: from_peer && held[rank] != furthest,
        bytes: if from_peer {
            (header.len() + 4 * floats) as u64
        } else {
            0
        },
    })
}

impl Run<'_> {
    /// Leaves `group` for `why` and returns the next round's group, with this worker's state
    /// the same as every other rank's. Joining or syncing the new group can fail (another node
    /// lost meanwhile): the worker then says so and waits for the round after. Ends with an
    /// error only when the agent gives up on regrouping (closes the channel: the worker exits
    /// as a lost peer's would, and is started again) or a stop is asked for (rank 0 of the old
    /// group checkpoints what all hold).
    pub(super) fn regroup(
        &mut self,
        group: ProcessGroup,
        mut why: Leave,
        control: &mut Control,
        report: &mut dyn FnMut(Event),
    ) -> Result<ProcessGroup> {
        let left = Instant::now();
        let world_size_before = self.world_size;
        let step_left = self.state.progress.global_step;
        // Closing its links now makes every peer still inside a collective fail at once.
        drop(group);
        // What the steps left in the model, for the state's checkpoint or broadcast.
        self.step.store(&mut self.state);
        let (reason, lost, saver) = match &why {
            Leave::Lost(e) => (format!("peer lost: {e}"), true, false),
            Leave::Paused { saver } => (
                "paused for a new round".to_string(),
                false,
                self.rank == *saver,
            ),
            Leave::Going => return Err(self.left()),
        };
        let mut save = protocol::saver_while_waiting(lost, saver, self.live);
        loop {
            let step = self.state.progress.global_step;
            let env = match control.next_round(Some(&why), step, &self.cfg.stop) {
                Ok(Next::Round(env)) => env,
                Ok(Next::Stop) => return Err(self.stop_while_regrouping(save, report)),
                Ok(Next::Leave) => return Err(self.left()),
                Err(e) => {
                    return Err(TrainError::Collective(CollectiveError::PeerLost(format!(
                        "{reason}; the agent did not regroup this worker ({e})"
                    ))));
                }
            };
            let world = world_from(&env, &self.world)?;
            match self.join_new_group(&world, control, report) {
                Ok((group, synced)) => {
                    let regrouped = Regrouped {
                        world_size_before: world_size_before as u32,
                        world_size: self.world_size as u32,
                        rank: self.rank as u32,
                        step: self.state.progress.global_step,
                        steps_dropped: step_left.saturating_sub(self.state.progress.global_step),
                        bytes: synced.bytes,
                        seconds: left.elapsed().as_secs_f64(),
                        received: synced.received,
                        assignments: 0, // the channel says its own count
                    };
                    self.recorder.regroup(&regrouped, &reason, report);
                    control.regrouped(regrouped);
                    return Ok(group);
                }
                Err(TrainError::Collective(e))
                    if protocol::after_start_failure(protocol::Failure::of(&e), true)
                        == protocol::AfterStartFailure::Regroup =>
                {
                    report(Event::Warning(format!(
                        "rank {}: the new group failed ({e}); waiting for the next round",
                        world.rank
                    )));
                    why = Leave::Lost(format!("joining the new group: {e}"));
                    save = protocol::saver_while_waiting(true, false, self.live);
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Joins the group `world` describes, as a worker that has just started would (join, the
    /// data barrier of [`super::Setup::prepare`], [`sync`]), and takes its place in it.
    fn join_new_group(
        &mut self,
        world: &World,
        control: &mut Control,
        report: &mut dyn FnMut(Event),
    ) -> Result<(ProcessGroup, Synced)> {
        let mut group = ProcessGroup::join(world)?;
        control.watch(&group);
        group.barrier()?;
        if !self.live {
            // What an earlier, broken stream left: the job's fresh state, for rank 0 to
            // replace with the checkpoint if no rank holds a live one.
            self.state = TrainState::fresh(
                self.cfg,
                &self.template,
                world.world_size as usize,
                self.setup.train.len(),
                self.state.info.clone(),
            );
        }
        let was_live = self.live;
        let synced = sync(
            self.cfg,
            &mut group,
            &mut self.state,
            &mut self.live,
            report,
        )?;
        // A peer's state, or (none live) the job's fresh or resumed one: the model takes it.
        if synced.received || !was_live {
            self.step.load(&self.state);
        }
        if world.rank as usize != self.rank {
            self.recorder = super::Recorder::open(&self.cfg.run_dir, world, report);
        }
        self.rank = group.rank();
        self.world_size = group.world_size();
        self.world = world.clone();
        Ok((group, synced))
    }

    /// This worker leaves the job (its node was asked to go), holding the step every rank
    /// paused at: the others go on from it, so nothing is saved.
    pub(super) fn left(&self) -> TrainError {
        TrainError::Left {
            global_step: self.state.progress.global_step,
            epoch: self.state.progress.epoch + 1,
        }
    }

    /// A stop (SIGTERM) while waiting for the next round: the survivors hold the same state
    /// (or one step apart), so the rank the tables name saves its own, as a stop at a step
    /// boundary would (`save`: [`protocol::saver_while_waiting`]).
    fn stop_while_regrouping(
        &mut self,
        save: protocol::Save,
        report: &mut dyn FnMut(Event),
    ) -> TrainError {
        if save != protocol::Save::No
            && let Err(e) = self.state.save(
                self.cfg,
                &self.template,
                save == protocol::Save::IfNewer,
                &mut self.recorder,
                report,
            )
        {
            return e;
        }
        TrainError::Preempted {
            global_step: self.state.progress.global_step,
            epoch: self.state.progress.epoch + 1,
        }
    }
}
