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
    let mut group = Group::spawn(
        spec,
        0,
        0,
        Start::Warm,
        launch.outputs(outputs.0, outputs.1),
        events,
    )?;
    loop {
        if let Some(signal) = launch.signals.received() {
            group.stop_interrupted(spec.grace);
            return Ok(Warmed::Stopped(signal));
        }
        group.read_messages();
        if group.can_regroup() {
            events(LaunchEvent::Warm {
                seconds: started.elapsed().as_secs_f64(),
            });
            return Ok(Warmed::Ready(Box::new(group)));
        }
        match group.poll() {
            Status::Running => {}
            Status::Succeeded => {
                return Ok(cold(
                    group,
                    spec,
                    "its workers ended before they said they were ready",
                ));
            }
            Status::Trouble(trouble) => {
                let failure = group.stop_troubled(spec.grace, trouble);
                return Ok(Warmed::Cold(Some(format!(
                    "its warm start failed ({}); it starts its workers once it has a place",
                    failure.summary()
                ))));
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
