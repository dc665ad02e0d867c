//! A warm start: a node joining a job under way starts its workers before it asks for a place
//! in the job. They run their start (imports, the data, the model: `contract::env::WARM_START`)
//! and say they are ready; only then does the agent join the rendezvous, and the others pause
//! for the state's transfer and the new group's start alone, not for the joiner's start. A
//! spare (a node waiting while the job is at `--nnodes` MAX) waits so, warm, and takes a lost
//! node's place the same way.

use std::time::{Duration, Instant};

use rendezvous::Rendezvous;

use crate::output::Sink;
use crate::supervise::{Group, Launch, Start, Status};
use crate::{LaunchError, LaunchEvent, LaunchSpec};

/// How a warm start ended.
pub(super) enum Warmed {
    /// The workers are ready: the node joins with them.
    Ready(Box<Group>),
    /// It was not worth it (a fresh job, or one whose workers restart at every change), or it
    /// failed (why): the node joins and starts its workers as usual.
    Cold(Option<String>),
    /// A stop signal came while the workers started.
    Stopped(i32),
}

/// Starts this node's workers warm when the job it joins is under way and regroups in place
/// (the record says so), and waits until every worker says it is ready.
pub(super) fn warm_up(
    spec: &LaunchSpec,
    rdzv: &mut Rendezvous,
    launch: &Launch,
    outputs: (&Sink, &Sink),
    events: &mut dyn FnMut(LaunchEvent),
) -> Result<Warmed, LaunchError> {
    if !(spec.regroup && spec.warm_start && rdzv.warm_start_pays()) {
        return Ok(Warmed::Cold(None));
    }
    events(LaunchEvent::Warming);
    let started = Instant::now();
    let group = spawn(spec, launch, outputs, events)?;
    Ok(until_ready(group, started, spec, launch, events))
}

fn spawn(
    spec: &LaunchSpec,
    launch: &Launch,
    outputs: (&Sink, &Sink),
    events: &mut dyn FnMut(LaunchEvent),
) -> Result<Group, LaunchError> {
    Group::spawn(
        spec,
        0,
        0,
        Start::Warm,
        launch.outputs(outputs.0, outputs.1),
        events,
    )
}

/// Waits until every warm worker of `group` (started at `started`) says it is ready.
fn until_ready(
    mut group: Group,
    started: Instant,
    spec: &LaunchSpec,
    launch: &Launch,
    events: &mut dyn FnMut(LaunchEvent),
) -> Warmed {
    loop {
        if let Some(signal) = launch.signals.received() {
            group.stop_interrupted(spec.grace);
            return Warmed::Stopped(signal);
        }
        group.read_messages();
        if group.can_regroup() {
            events(LaunchEvent::Warm {
                seconds: started.elapsed().as_secs_f64(),
            });
            return Warmed::Ready(Box::new(group));
        }
        match group.poll() {
            Status::Running => {}
            Status::Succeeded => {
                return cold(
                    group,
                    spec,
                    "its workers ended before they said they were ready",
                );
            }
            Status::Trouble(trouble) => {
                let failure = group.stop_troubled(spec.grace, trouble);
                return Warmed::Cold(Some(format!(
                    "its warm start failed ({}); it starts its workers once it has a place",
                    failure.summary()
                )));
            }
        }
        std::thread::sleep(spec.monitor_interval.max(Duration::from_millis(10)));
    }
}

fn cold(group: Group, spec: &LaunchSpec, why: &str) -> Warmed {
    group.stop(spec.grace);
    Warmed::Cold(Some(format!(
        "{why}; it starts its workers once it has a place"
    )))
}

/// A node that waits for a place with cold workers (it arrived before the job said its
/// workers regroup in place: a spare launched with the job) starts them warm once the
/// rendezvous says a warm start pays, and goes on waiting: it stays in the rendezvous, so a
/// round that reopens meanwhile still counts it.
pub(super) struct WhileWaiting {
    /// Whether this node may start warm at all (`--regroup in-process`, `--warm-start auto`,
    /// and no workers kept from a round).
    allowed: bool,
    started: Option<(Group, Instant)>,
}

impl WhileWaiting {
    pub(super) fn new(spec: &LaunchSpec, has_workers: bool) -> WhileWaiting {
        WhileWaiting {
            allowed: spec.regroup && spec.warm_start && !has_workers,
            started: None,
        }
    }

    /// What the join said as it waits (`warm_start_pays`): starts the workers warm at the
    /// first word that it pays.
    pub(super) fn heard(
        &mut self,
        warm_start_pays: bool,
        spec: &LaunchSpec,
        launch: &Launch,
        outputs: (&Sink, &Sink),
        events: &mut dyn FnMut(LaunchEvent),
    ) {
        if !(self.allowed && warm_start_pays && self.started.is_none()) {
            return;
        }
        events(LaunchEvent::WarmingWhileWaiting);
        match spawn(spec, launch, outputs, events) {
            Ok(group) => self.started = Some((group, Instant::now())),
            Err(e) => {
                self.allowed = false;
                events(LaunchEvent::WarmStartFailed(format!(
                    "{e}; it starts its workers once it has a place"
                )));
            }
        }
    }

    /// The join ended in a place: the workers started while waiting, once ready (the rest of
    /// their start, if any, is waited for here, as a cold start would be), or `None`.
    pub(super) fn ready(
        self,
        spec: &LaunchSpec,
        launch: &Launch,
        events: &mut dyn FnMut(LaunchEvent),
    ) -> Option<Box<Group>> {
        let (group, started) = self.started?;
        match until_ready(group, started, spec, launch, events) {
            Warmed::Ready(group) => Some(group),
            Warmed::Cold(why) => {
                if let Some(why) = why {
                    events(LaunchEvent::WarmStartFailed(why));
                }
                None
            }
            // Its workers are stopped; the round's own watch hears the signal.
            Warmed::Stopped(_) => None,
        }
    }

    /// The join ended without a place: the workers started while waiting, to stop.
    pub(super) fn into_group(self) -> Option<Box<Group>> {
        self.started.map(|(group, _)| Box::new(group))
    }
}
