//! What a launch keeps across its attempts (the stop signals, where the workers write, the
//! file-timer server), and torchrun's static launch: one group, restarted whole on a failure.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use super::{Group, Status};
use crate::output::{Activity, Sink};
use crate::report::{Failure, Outcome};
use crate::telemetry::TelemetryPipe;
use crate::timer::TimerServer;
use crate::{LaunchError, LaunchEvent, LaunchSpec};

/// Signals that stop the whole launch; the handler only records the signal number.
const STOP_SIGNALS: [i32; 3] = [
    signal_hook::consts::SIGINT,
    signal_hook::consts::SIGTERM,
    signal_hook::consts::SIGHUP,
];

/// The stop signal received, if any (0: none): one latch for the process, set by the handlers
/// [`record_stop_signals`] installs.
static RECEIVED: AtomicUsize = AtomicUsize::new(0);
static INSTALLED: OnceLock<Result<(), String>> = OnceLock::new();

/// Records SIGINT, SIGTERM and SIGHUP from now on instead of obeying them; the launch acts on
/// them once it can. Call it first thing: a signal that comes before is lost when `trainctl`
/// runs as a container's PID 1 (the kernel drops a signal PID 1 has no handler for), so a pod
/// deleted as it starts would start anyway and join the job. Installed once per process.
pub fn record_stop_signals() -> Result<(), LaunchError> {
    let installed = INSTALLED.get_or_init(|| {
        for sig in STOP_SIGNALS {
            // SAFETY: the handler only stores into an atomic, which is async-signal-safe.
            unsafe {
                signal_hook::low_level::register(sig, move || {
                    RECEIVED.store(sig as usize, Ordering::SeqCst)
                })
            }
            .map_err(|e| e.to_string())?;
        }
        Ok(())
    });
    installed
        .clone()
        .map_err(|e| LaunchError::Signals(std::io::Error::other(e)))
}

/// The stop signal recorded so far (see [`record_stop_signals`]), if any.
pub fn stop_signal() -> Option<i32> {
    match RECEIVED.load(Ordering::SeqCst) {
        0 => None,
        sig => Some(sig as i32),
    }
}

/// SIGINT, SIGTERM and SIGHUP, recorded instead of obeyed (see [`record_stop_signals`]).
pub(crate) struct StopSignals;

impl StopSignals {
    pub(crate) fn install() -> Result<Self, LaunchError> {
        record_stop_signals()?;
        Ok(StopSignals)
    }

    /// The signal received, if any.
    pub(crate) fn received(&self) -> Option<i32> {
        stop_signal()
    }
}

/// Runs the workers of this node to completion and says how it ended; `events` hears of each
/// worker started and of each restart. A failed group is restarted whole, with
/// TORCHELASTIC_RESTART_COUNT one higher, up to `spec.max_restarts` times.
pub fn launch(
    spec: &LaunchSpec,
    stdout: Sink,
    stderr: Sink,
    events: &mut dyn FnMut(LaunchEvent),
) -> Result<Outcome, LaunchError> {
    let launch = Launch::open(spec)?;
    let (signals, timers) = (&launch.signals, launch.timers.as_ref());
    let mut restart_count = 0;
    loop {
        let mut group = Group::spawn(
            spec,
            restart_count,
            restart_count.into(),
            super::Start::Plain,
            launch.outputs(&stdout, &stderr),
            events,
        )?;
        let failure = loop {
            if let Some(signal) = signals.received() {
                let checkpointed = group.stop_interrupted(spec.grace);
                return Ok(Outcome::Interrupted {
                    signal,
                    checkpointed,
                });
            }
            match group.poll() {
                Status::Running => std::thread::sleep(spec.monitor_interval),
                Status::Succeeded => {
                    group.stop(spec.grace);
                    return Ok(Outcome::Succeeded);
                }
                Status::Trouble(t) => {
                    break with_timer(group.stop_troubled(spec.grace, t), timers);
                }
            }
        };
        if restart_count >= spec.max_restarts
            || signals.received().is_some()
            || failure.unrecoverable()
        {
            return Ok(Outcome::Failed(Box::new(failure)));
        }
        restart_count += 1;
        events(LaunchEvent::Restarting {
            failure,
            restart_count,
        });
    }
}

/// Where a group's workers write: their stdout and stderr sinks, and the telemetry pipe.
/// What a launch keeps across its attempts (both `launch` and the elastic agent): the stop
/// signals, the workers' activity clock, the telemetry pipe and the file-timer server.
pub(crate) struct Launch {
    pub signals: StopSignals,
    activity: Arc<Activity>,
    telemetry: Option<TelemetryPipe>,
    pub timers: Option<TimerServer>,
}

impl Launch {
    pub(crate) fn open(spec: &LaunchSpec) -> Result<Launch, LaunchError> {
        let signals = StopSignals::install()?;
        let activity = Arc::new(Activity::default());
        let telemetry = TelemetryPipe::open_for(spec, &activity)?;
        let timers = TimerServer::open_for(spec)?;
        Ok(Launch {
            signals,
            activity,
            telemetry,
            timers,
        })
    }

    /// What an attempt's workers write to, with `stdout` and `stderr`.
    pub(crate) fn outputs<'a>(&'a self, stdout: &'a Sink, stderr: &'a Sink) -> Outputs<'a> {
        Outputs {
            stdout,
            stderr,
            telemetry: self.telemetry.as_ref(),
            timers: self.timers.as_ref(),
            activity: &self.activity,
        }
    }
}

/// What a launch's groups share: where the workers write (stdout and stderr sinks, the
/// telemetry pipe), the file-timer server, and the clock of their last line.
#[derive(Clone, Copy)]
pub(crate) struct Outputs<'a> {
    pub stdout: &'a Sink,
    pub stderr: &'a Sink,
    pub telemetry: Option<&'a TelemetryPipe>,
    pub timers: Option<&'a TimerServer>,
    pub activity: &'a Arc<Activity>,
}

/// `failure` with the file-based timer that expired for its worker, if one did.
pub(crate) fn with_timer(mut failure: Failure, timers: Option<&TimerServer>) -> Failure {
    failure.timer = timers.and_then(|t| t.expired(failure.rank));
    failure
}
