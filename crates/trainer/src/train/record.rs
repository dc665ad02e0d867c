//! What a worker records as it trains: its metrics file (every rank,
//! `RUN_DIR/metrics/rank-N.jsonl`), TensorBoard event files (rank 0, `RUN_DIR/tensorboard/`),
//! and the same records down the launcher's pipe (`TRAINCTL_TELEMETRY_FD`), which feeds
//! `trainctl run`'s progress bar and `/metrics`.
//!
//! Recording never stops training: a destination that fails is reported once (as a warning)
//! and dropped.

use std::io::Write;
use std::path::Path;

use collective::World;
use telemetry::metrics::{
    Checkpoint, EpochDone, Eval, Record, Regroup, Start, Straggler, rank_file,
};
use telemetry::tfevents::EventWriter;
use telemetry::{MetricsWriter, RunConfig, Step};

use super::Event;
use crate::eval::Confusion;

pub(crate) struct Recorder {
    rank: u32,
    metrics: Option<MetricsWriter>,
    tensorboard: Option<EventWriter>,
    pipe: Option<std::fs::File>,
}

impl Recorder {
    /// Opens this rank's destinations under `run_dir`.
    pub(crate) fn open(run_dir: &Path, world: &World, report: &mut dyn FnMut(Event)) -> Self {
        let metrics = MetricsWriter::open(&rank_file(run_dir, world.rank))
            .map_err(|e| warn(report, "metrics file", &e))
            .ok();
        let tensorboard = (world.rank == 0)
            .then(|| {
                EventWriter::create(&run_dir.join("tensorboard"))
                    .map_err(|e| warn(report, "TensorBoard events", &e))
                    .ok()
            })
            .flatten();
        let pipe = world.telemetry_fd.and_then(|fd| match telemetry_pipe(fd) {
            Ok(f) => Some(f),
            Err(e) => {
                warn(report, "the launcher's telemetry pipe", &e);
                None
            }
        });
        Recorder {
            rank: world.rank,
            metrics,
            tensorboard,
            pipe,
        }
    }

    fn record(&mut self, record: &Record, report: &mut dyn FnMut(Event)) {
        let line = record.to_line();
        if let Some(m) = self.metrics.as_mut()
            && let Err(e) = m.write_line(&line)
        {
            warn(report, "metrics file", &e);
            self.metrics = None;
        }
        // One write of one line below PIPE_BUF: lines of the node's workers never interleave.
        if let Some(p) = self.pipe.as_mut()
            && let Err(e) = p.write_all(&line)
        {
            warn(report, "the launcher's telemetry pipe", &e);
            self.pipe = None;
        }
    }

    /// A straggler found or gone (rank 0).
    pub(crate) fn straggler(&mut self, straggler: Straggler, report: &mut dyn FnMut(Event)) {
        self.record(&Record::Straggler(straggler), report);
    }

    fn tensorboard(
        &mut self,
        report: &mut dyn FnMut(Event),
        write: impl FnOnce(&mut EventWriter) -> Result<(), telemetry::tfevents::EventFileError>,
    ) {
        if let Some(tb) = self.tensorboard.as_mut()
            && let Err(e) = write(tb)
        {
            warn(report, "TensorBoard events", &e);
            self.tensorboard = None;
        }
    }

    pub(crate) fn start(&mut self, start: Start, world_size: usize, report: &mut dyn FnMut(Event)) {
        let (step, text) = (start.step, config_markdown(&start.config, world_size));
        self.record(&Record::Start(start), report);
        self.tensorboard(report, |tb| {
            // TensorBoard drops what an earlier attempt wrote from the next step on (the
            // steps a restarted run does again); it keeps the steps up to the checkpoint.
            tb.session_start(step + 1)?;
            tb.text(step, "config", &text)
        });
    }

    pub(crate) fn step(&mut self, s: &Step, report: &mut dyn FnMut(Event)) {
        self.record(&Record::Step(s.clone()), report);
        self.tensorboard(report, |tb| {
            tb.scalars(
                s.step,
                &[
                    ("train/loss", s.loss as f64),
                    ("train/accuracy", s.accuracy as f64 * 100.0),
                    ("train/images_per_sec", s.images_per_sec),
                    ("train/allreduce_seconds", s.allreduce_s),
                    ("train/step_seconds", s.step_s),
                    ("train/learning_rate", s.lr),
                    ("train/world_size", s.world_size as f64),
                ],
            )
        });
    }

    pub(crate) fn regroup(
        &mut self,
        r: &collective::control::Regrouped,
        reason: &str,
        report: &mut dyn FnMut(Event),
    ) {
        let record = Record::Regroup(Regroup {
            time: telemetry::unix_time(),
            rank: r.rank,
            world_size_before: r.world_size_before,
            world_size: r.world_size,
            step: r.step,
            steps_dropped: r.steps_dropped,
            bytes: r.bytes,
            received: r.received,
            seconds: r.seconds,
            reason: reason.to_string(),
        });
        self.record(&record, report);
        self.tensorboard(report, |tb| {
            tb.scalars(r.step, &[("train/world_size", r.world_size as f64)])
        });
    }

    pub(crate) fn checkpoint(
        &mut self,
        step: u64,
        epoch: usize,
        position: usize,
        report: &mut dyn FnMut(Event),
    ) {
        let r = Record::Checkpoint(Checkpoint {
            time: telemetry::unix_time(),
            rank: self.rank,
            step,
            epoch,
            position,
        });
        self.record(&r, report);
    }

    pub(crate) fn epoch(
        &mut self,
        epoch: usize,
        step: u64,
        seconds: f64,
        digest: u64,
        report: &mut dyn FnMut(Event),
    ) {
        let r = Record::Epoch(EpochDone {
            time: telemetry::unix_time(),
            rank: self.rank,
            epoch,
            step,
            seconds,
            samples_digest: Some(format!("{digest:016x}")),
        });
        self.record(&r, report);
    }

    pub(crate) fn eval(&mut self, step: u64, confusion: &Confusion, report: &mut dyn FnMut(Event)) {
        let eval = eval_record(self.rank, step, confusion);
        let mut scalars = vec![("test/accuracy".to_string(), eval.accuracy)];
        if let Some(top5) = eval.top5_accuracy {
            scalars.push(("test/top5_accuracy".to_string(), top5));
        }
        for (name, acc) in eval.classes.iter().zip(&eval.class_accuracy) {
            if let Some(acc) = acc {
                scalars.push((format!("test/accuracy/{name}"), *acc));
            }
        }
        self.record(&Record::Eval(eval), report);
        self.tensorboard(report, |tb| {
            let s: Vec<(&str, f64)> = scalars.iter().map(|(t, v)| (t.as_str(), *v)).collect();
            tb.scalars(step, &s)
        });
    }
}

/// The evaluation as a metrics record (also what `trainctl eval --confusion-matrix` writes).
pub fn eval_record(rank: u32, step: u64, confusion: &Confusion) -> Eval {
    Eval {
        time: telemetry::unix_time(),
        rank,
        step,
        images: confusion.total(),
        accuracy: confusion.accuracy(),
        classes: confusion.classes.clone(),
        class_accuracy: (0..confusion.classes())
            .map(|c| confusion.class_accuracy(c))
            .collect(),
        confusion: (0..confusion.classes())
            .map(|c| confusion.row(c).to_vec())
            .collect(),
        top5_accuracy: confusion.top5_accuracy(),
    }
}

/// The run's settings as a Markdown table, for TensorBoard's Text tab.
fn config_markdown(c: &RunConfig, world_size: usize) -> String {
    let mut out = String::from("| setting | value |\n|---|---|\n");
    let mut rows = c.rows();
    rows.insert(1, ("world size", world_size.to_string()));
    for (k, v) in rows {
        out.push_str(&format!("| {k} | {} |\n", v.replace('|', "\\|")));
    }
    out
}

fn warn(report: &mut dyn FnMut(Event), what: &str, e: &dyn std::fmt::Display) {
    report(Event::Warning(format!(
        "cannot write the {what} ({e}); training goes on without it"
    )));
}

/// The pipe `trainctl run` passed down, duplicated so the inherited descriptor is never
/// closed under someone else; anything but a pipe is refused.
fn telemetry_pipe(fd: i32) -> std::io::Result<std::fs::File> {
    use std::os::fd::BorrowedFd;
    use std::os::unix::fs::FileTypeExt;
    // SAFETY: only borrowed for the `dup`; a descriptor that is not open makes `dup` fail
    // with EBADF, which is returned.
    let owned = unsafe { BorrowedFd::borrow_raw(fd) }.try_clone_to_owned()?;
    let file = std::fs::File::from(owned);
    if !file.metadata()?.file_type().is_fifo() {
        return Err(std::io::Error::other(format!(
            "descriptor {fd} is not a pipe"
        )));
    }
    Ok(file)
}
