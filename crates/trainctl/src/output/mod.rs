//! Everything trainctl prints for the user goes through here (the Kubernetes commands' words in
//! [`kube`]).
//!
//! While a progress bar is up (on a terminal), every line goes above it: written with the bar
//! suspended, so lines and bar never share a row.

pub(crate) mod diagnostics;
pub(crate) mod kube;
mod launch;

pub(crate) use launch::launch_event;

use std::fmt::Arguments;
use std::io::Write;
use std::sync::Mutex;

use indicatif::{ProgressBar, ProgressStyle};
use trainer::data::DataProgress;
use trainer::train::Event;

/// The progress bar on screen, if any.
static BAR: Mutex<Option<ProgressBar>> = Mutex::new(None);

/// Writes `text` to stdout or stderr, above the progress bar when one is up.
///
/// The bar's slot stays locked for the whole write: a bar cannot be registered (and then drawn)
/// between deciding there is none and writing, which would put the line on the bar's row.
pub(crate) fn emit(stderr: bool, text: &[u8]) {
    let bar = BAR.lock().unwrap_or_else(|p| p.into_inner());
    let write = || {
        if stderr {
            let _ = std::io::stderr().lock().write_all(text);
        } else {
            let mut out = std::io::stdout().lock();
            let _ = out.write_all(text);
            let _ = out.flush();
        }
    };
    match bar.as_ref() {
        Some(bar) => bar.suspend(write),
        None => write(),
    }
}

fn out(args: Arguments) {
    emit(false, format!("{args}\n").as_bytes());
}

fn out_raw(args: Arguments) {
    emit(false, args.to_string().as_bytes());
}

fn err(args: Arguments) {
    emit(true, format!("{args}\n").as_bytes());
}

/// A worker's output forwarded by the launcher, a whole line at a time, so that a progress bar
/// can be suspended around each line (the launcher writes a prefix and a line separately).
pub(crate) struct LineSink {
    stderr: bool,
    pending: Vec<u8>,
}

impl LineSink {
    pub(crate) fn new(stderr: bool) -> Self {
        LineSink {
            stderr,
            pending: Vec::new(),
        }
    }
}

impl Write for LineSink {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.pending.extend_from_slice(buf);
        if let Some(end) = self.pending.iter().rposition(|&b| b == b'\n') {
            let rest = self.pending.split_off(end + 1);
            emit(self.stderr, &std::mem::replace(&mut self.pending, rest));
        }
        Ok(buf.len())
    }

    /// Emits a partial last line too (the launcher's pump flushes after whole lines only).
    fn flush(&mut self) -> std::io::Result<()> {
        if !self.pending.is_empty() {
            emit(self.stderr, &std::mem::take(&mut self.pending));
        }
        Ok(())
    }
}

/// A long count said in plain lines at every tenth ("evaluating: 5000 of 10000 images
/// (50 %)"), on a terminal or not: a pod's log shows the test job at work.
pub(crate) struct Tenths {
    what: &'static str,
    unit: &'static str,
    last: Option<usize>,
}

impl Tenths {
    pub(crate) fn new(what: &'static str, unit: &'static str) -> Tenths {
        Tenths {
            what,
            unit,
            last: None,
        }
    }

    pub(crate) fn update(&mut self, done: usize, total: usize) {
        if total == 0 {
            return;
        }
        let tenth = done * 10 / total;
        if self.last != Some(tenth) {
            self.last = Some(tenth);
            err(format_args!(
                "{}: {done} of {total} {} ({} %)",
                self.what,
                self.unit,
                done * 100 / total
            ));
        }
    }
}

/// Progress of the data download and of training: a bar on a terminal; on anything else
/// (a pod's log, CI) plain lines, at every tenth of a download (and at least every
/// [`SLOW_LINES`] while bytes arrive) and at the loss lines.
pub(crate) struct ProgressDisplay {
    terminal: bool,
    bar: Option<ProgressBar>,
    /// The epoch or data phase the bar shows.
    showing: Option<String>,
    /// Last tenth of the download reported as a plain line, and when.
    tenth: Option<(&'static str, u64, std::time::Instant)>,
    /// What the download or extraction under way gets (CIFAR-10, tiny-imagenet-200).
    what: &'static str,
    /// The losses of the epoch's last [`BAR_LOSS_STEPS`] steps, for the bar's mean.
    recent: std::collections::VecDeque<f32>,
}

/// The bar shows the loss averaged over this many steps (as the loss lines average theirs),
/// not one step's.
const BAR_LOSS_STEPS: usize = 10;

/// A slow download still says how far it has come this often, between its tenths.
const SLOW_LINES: std::time::Duration = std::time::Duration::from_secs(30);

impl ProgressDisplay {
    pub(crate) fn new(terminal: bool) -> Self {
        ProgressDisplay {
            terminal,
            bar: None,
            showing: None,
            tenth: None,
            what: "the data set",
            recent: Default::default(),
        }
    }

    fn show(&mut self, what: String, len: u64, template: &str) -> &ProgressBar {
        if self.showing.as_deref() != Some(what.as_str()) {
            self.finish();
            // Registered before it can first draw, under the lock `emit` writes under.
            let mut slot = BAR.lock().unwrap_or_else(|p| p.into_inner());
            let bar = ProgressBar::new(len).with_style(
                ProgressStyle::with_template(template)
                    .unwrap_or_else(|_| ProgressStyle::default_bar())
                    .progress_chars("=> "),
            );
            bar.set_prefix(what.clone());
            *slot = Some(bar.clone());
            drop(slot);
            self.bar = Some(bar);
            self.showing = Some(what);
        }
        self.bar.as_ref().expect("a bar was just set")
    }

    pub(crate) fn data(&mut self, p: DataProgress) {
        let (phase, done, total) = match p {
            DataProgress::Downloading { done, total } => ("downloading", done, total),
            DataProgress::Extracting { done, total } => ("extracting", done, Some(total)),
            DataProgress::Fetching {
                what,
                url,
                dir,
                created,
            } => {
                self.what = what;
                err(format_args!(
                    "downloading {what} from {url} into {}{}",
                    dir.display(),
                    if created {
                        " (a new folder: it did not exist; check --data if that is not the folder you meant)"
                    } else {
                        ""
                    }
                ));
                return;
            }
            DataProgress::Retrying {
                problem,
                after,
                from,
                tries_left,
            } => {
                warn(&format!(
                    "{problem}; trying again in {} from byte {from} ({tries_left} more {} unless bytes come)",
                    duration(after.as_secs_f64()),
                    if tries_left == 1 { "try" } else { "tries" }
                ));
                return;
            }
            DataProgress::Waiting { rank } => {
                err(format_args!(
                    "waiting for rank {rank} (local rank 0) to get the data set for this node; its lines say how far it has come"
                ));
                return;
            }
            DataProgress::Done => {
                self.finish();
                self.tenth = None;
                return;
            }
        };
        let what = self.what;
        if self.terminal {
            let bar = self.show(
                format!("{phase} {what}"),
                total.unwrap_or(0),
                "{prefix} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}",
            );
            bar.set_position(done);
            return;
        }
        // Tenths of the archive, or every 16 MiB when the server sent no length.
        let tenth = match total {
            Some(t) if t > 0 => done * 10 / t,
            _ => done >> 24,
        };
        let due = match self.tenth {
            Some((was, last, at)) if was == phase && last == tenth => at.elapsed() >= SLOW_LINES,
            _ => true,
        };
        if due {
            self.tenth = Some((phase, tenth, std::time::Instant::now()));
            let mb = |b: u64| b as f64 / 1e6;
            match total {
                Some(t) if t > 0 => err(format_args!(
                    "{phase} {what}: {:.1} of {:.1} MB ({} %)",
                    mb(done),
                    mb(t),
                    done * 100 / t
                )),
                _ => err(format_args!("{phase} {what}: {:.1} MB", mb(done))),
            }
        }
    }

    /// Rank 0's steps drive the bar (a terminal only: elsewhere the loss lines say as much).
    pub(crate) fn step(&mut self, s: &telemetry::Step) {
        if !self.terminal || s.rank != 0 {
            return;
        }
        let label = format!("epoch {}", s.epoch);
        if self.showing.as_ref() != Some(&label) {
            self.recent.clear();
        }
        if self.recent.len() == BAR_LOSS_STEPS {
            self.recent.pop_front();
        }
        self.recent.push_back(s.loss);
        let mean = self.recent.iter().sum::<f32>() / self.recent.len() as f32;
        let bar = self.show(
            label,
            s.steps_in_epoch as u64,
            "{prefix} [{bar:20}] {pos}/{len} | {msg} | eta {eta}",
        );
        if bar.length() != Some(s.steps_in_epoch as u64) {
            // The world size changed mid-epoch: so did the number of steps.
            bar.set_length(s.steps_in_epoch as u64);
            bar.reset_eta();
        }
        // Mean over the last steps, as the loss lines' (one line on an 80-column terminal).
        bar.set_message(format!(
            "mean loss {mean:.3} | {:.1} img/s",
            s.images_per_sec
        ));
        bar.set_position(s.iter as u64);
    }

    pub(crate) fn finish(&mut self) {
        if let Some(bar) = self.bar.take() {
            *BAR.lock().unwrap_or_else(|p| p.into_inner()) = None;
            bar.finish_and_clear();
        }
        self.showing = None;
    }
}

impl Drop for ProgressDisplay {
    fn drop(&mut self) {
        self.finish();
    }
}

/// `1m05s`, `2h03m`, `12s`.
fn duration(seconds: f64) -> String {
    let s = seconds.max(0.0).round() as u64;
    match s {
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m{:02}s", s / 60, s % 60),
        _ => format!("{}h{:02}m", s / 3600, s % 3600 / 60),
    }
}

pub(crate) fn error(e: &anyhow::Error) {
    err(format_args!("error: {}", chain(e)));
}

/// An error and its causes, `: `-separated like anyhow's `{:#}`, each cause once: an error
/// whose message already quotes its source (thiserror's `"...: {source}"`) is not followed by
/// that source again.
pub(crate) fn chain(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain() {
        let said = cause.to_string();
        if text.contains(&said) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&said);
    }
    text
}

/// How to go on from a checkpoint a stop saved: in a pod (the kubelet sets
/// KUBERNETES_SERVICE_HOST) a replacement pod resumes it by itself, if the Job makes one (not
/// after `job delete`, which the pod cannot tell from an eviction); elsewhere the same command
/// does.
pub(crate) fn resume_hint() -> &'static str {
    if collective::world::is_set(contract::env::KUBERNETES_SERVICE_HOST) {
        "a replacement pod resumes from it if the Job makes one (none comes after `trainctl job delete`); `trainctl job launch` with the same --name does too"
    } else {
        "run the same command again to resume from it"
    }
}

pub(crate) fn warn(msg: &str) {
    err(format_args!("warning: {msg}"));
}

pub(crate) fn wrote(path: &std::path::Path) {
    err(format_args!("wrote {}", path.display()));
}

pub(crate) fn report_written(w: &report::Written, dir: &std::path::Path) {
    for chart in &w.charts {
        out(format_args!("{}", dir.join(&chart.file).display()));
    }
    out(format_args!("{}", w.html.display()));
    out(format_args!("{}", w.json.display()));
    if w.skipped_lines > 0 {
        warn(&format!(
            "{} metrics line(s) could not be read (a crash leaves a partial last line); the rest is in the report",
            w.skipped_lines
        ));
    }
}

fn megabytes(bytes: u64) -> String {
    format!("{:.1} MB", bytes as f64 / 1e6)
}

pub(crate) fn stage_progress(p: &objects::StageProgress) {
    err(format_args!(
        "staging: {}/{} files, {} of {} copied",
        p.files_done,
        p.files_total,
        megabytes(p.bytes_copied),
        megabytes(p.bytes_to_copy)
    ));
}

/// The summary of a staging: the result on stdout for `data stage`, a diagnostic on stderr
/// before `run`'s workers start.
pub(crate) fn staged(
    from: &objects::S3Uri,
    dir: &std::path::Path,
    s: &objects::StageSummary,
    stderr: bool,
) {
    let line = format!(
        "staged {from} into {}: {} files ({} copied, {} already there), {} copied in {:.1} s ({:.1} MB/s)",
        dir.display(),
        s.files,
        s.copied,
        s.skipped,
        megabytes(s.bytes_copied),
        s.seconds,
        s.megabytes_per_second()
    );
    if stderr {
        err(format_args!("{line}"));
    } else {
        out(format_args!("{line}"));
    }
}

pub(crate) fn uploaded(path: &std::path::Path, to: &objects::S3Uri, bytes: u64) {
    err(format_args!(
        "uploaded {} to {to} ({})",
        path.display(),
        megabytes(bytes)
    ));
}

pub(crate) fn upload_failed(path: &std::path::Path, to: &objects::S3Uri, e: &objects::Error) {
    warn(&format!(
        "could not upload {} to {to}: {e}. The local copy stays; upload it later with `aws s3 cp {} {to}`",
        path.display(),
        path.display()
    ));
}

pub(crate) fn uploads_not_tried(files: &[std::path::PathBuf], to: &objects::S3Uri) {
    let names: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
    warn(&format!(
        "{} more file(s) were not sent to {to} after that refusal; they stay on disk: {}",
        files.len(),
        names.join(", ")
    ));
}

pub(crate) fn metrics_endpoint(addr: std::net::SocketAddr) {
    err(format_args!(
        "trainctl run: serving metrics at http://{addr}/metrics"
    ));
}

pub(crate) fn launching(spec: &launcher::LaunchSpec) {
    err(format_args!(
        "trainctl run: run id {}, {} worker(s) on this node, world size {}, store at {}:{}",
        spec.run_id, spec.nproc_per_node, spec.world_size, spec.master_addr, spec.master_port
    ));
}

pub(crate) fn agent_starting(spec: &launcher::LaunchSpec, rdzv: &launcher::rendezvous::Rendezvous) {
    let cfg = rdzv.config();
    err(format_args!(
        "trainctl run: elastic agent {} for run id {}, {} worker(s) on this node, {}..{} nodes; rendezvous: {}",
        rdzv.node_id(),
        spec.run_id,
        spec.nproc_per_node,
        cfg.limits.min,
        cfg.limits.max,
        rdzv.describe()
    ));
}

/// Prints a training event the way the seed jobs print theirs.
pub(crate) fn train_event(event: trainer::train::Event) {
    match event {
        Event::Resumed {
            epoch,
            position,
            global_step,
            saved_world_size,
        } => out(format_args!(
            "resuming from checkpoint: epoch {}, {position} samples into it, step {global_step} (saved at world size {saved_world_size})",
            epoch + 1
        )),
        Event::Loss {
            epoch,
            iter,
            steps,
            loss,
            images_per_sec,
            seconds_per_step,
        } => out(format_args!(
            "[{epoch}, {iter:5}] loss: {loss:.3}  ({iter}/{steps} steps, {images_per_sec:.1} images/s, epoch eta {})",
            duration(steps.saturating_sub(iter) as f64 * seconds_per_step)
        )),
        // Drawn by `ProgressDisplay`, recorded by the trainer.
        Event::Step(_) | Event::Data(_) => {}
        Event::CheckpointSaved {
            global_step,
            epoch,
            position,
        } => out(format_args!(
            "checkpoint saved at step {global_step} (epoch {}, {position} samples in)",
            epoch + 1
        )),
        Event::EpochDone { epoch, seconds } => {
            out(format_args!("epoch {epoch} done in {seconds:.1} s"))
        }
        Event::ModelSaved { path } => out(format_args!("model saved to {}", path.display())),
        Event::Evaluated(confusion) => out_raw(format_args!("{}", confusion.report())),
        Event::Finished {
            rank,
            global_step,
            samples_seen,
            world_size,
            fingerprint,
        } => out(format_args!(
            "rank {rank} finished after {global_step} steps; weights fingerprint {fingerprint:08x} (world size {world_size}, {samples_seen} samples trained in all)"
        )),
        Event::Warning(msg) => warn(&msg),
        Event::Straggler { report, .. } => out(format_args!("{report}")),
    }
}

pub(crate) fn checkpoint(path: &std::path::Path, p: &trainer::checkpoint::Progress, json: bool) {
    if json {
        out(format_args!(
            "{}",
            serde_json::to_string(p).unwrap_or_default()
        ));
        return;
    }
    out(format_args!(
        "{}: verified (checksum, tensor names and shapes)",
        path.display()
    ));
    out(format_args!(
        "  epoch        : {} done, {} samples into the next",
        p.epoch, p.position
    ));
    out(format_args!("  global step  : {}", p.global_step));
    out(format_args!(
        "  samples seen : {} (data set {} images)",
        p.samples_seen, p.dataset_len
    ));
    out(format_args!("  world size   : {} when saved", p.world_size));
    out(format_args!(
        "  settings     : batch {}, lr {}, momentum {}, weight decay {}, seed {}",
        p.batch_size, p.learning_rate, p.momentum, p.weight_decay, p.seed
    ));
}

#[cfg(test)]
mod tests {
    use super::chain;

    #[derive(Debug)]
    struct Quoting(std::io::Error);

    impl std::fmt::Display for Quoting {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "cannot start worker 0 (train): {}", self.0)
        }
    }

    impl std::error::Error for Quoting {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn a_cause_the_message_already_quotes_is_said_once() {
        let io = std::io::Error::from(std::io::ErrorKind::NotFound);
        let said = io.to_string();
        let e = anyhow::Error::new(Quoting(io)).context("trainctl run");
        assert_eq!(
            chain(&e),
            format!("trainctl run: cannot start worker 0 (train): {said}")
        );
        assert_eq!(chain(&e).matches(&said).count(), 1);
        // Causes that add something are all kept, in order.
        let plain = anyhow::anyhow!("disk full").context("writing runs/x/model.safetensors");
        assert_eq!(chain(&plain), "writing runs/x/model.safetensors: disk full");
    }
}
