//! Everything a checkpoint holds, as flat buffers, and what is done to it: fresh start,
//! resume (refusing a checkpoint of another run), the broadcast header, the SGD update.

use kernels::sgd::Sgd;

use super::record::Recorder;
use crate::checkpoint::{
    ModelInfo, Progress, load_checkpoint, save_checkpoint, save_checkpoint_if_newer,
};
use crate::error::{Result, TrainError};
use crate::model::{Net, Snapshot, StepGradients, sgd_step, snapshot};

use super::{Event, TrainConfig};

/// The resume header's size: a flag and five u64s.
pub(super) const HEADER_BYTES: usize = 1 + 5 * 8;

/// Everything a checkpoint holds, as flat buffers.
pub(super) struct TrainState {
    pub(super) progress: Progress,
    pub(super) info: ModelInfo,
    /// The trainable parameters, flat. A step updates the model's own tensors instead
    /// ([`Self::sgd_step`]), which leaves these behind (emptied, not kept as a stale copy)
    /// until [`Self::take_params`] reads them back; [`Self::params`] refuses to hand out old
    /// ones meanwhile.
    params: Vec<f32>,
    /// The model holds newer parameters than `params`.
    params_behind: bool,
    pub(super) buffers: Vec<f32>,
    pub(super) momentum: Vec<f32>,
}

impl TrainState {
    pub(super) fn fresh(
        cfg: &TrainConfig,
        template: &Snapshot,
        world_size: usize,
        dataset_len: usize,
        info: ModelInfo,
    ) -> Self {
        TrainState {
            info,
            progress: Progress {
                epoch: 0,
                position: 0,
                global_step: 0,
                samples_seen: 0,
                epoch_digest: 0,
                seed: cfg.seed,
                world_size,
                dataset_len,
                batch_size: cfg.batch_size,
                learning_rate: cfg.learning_rate,
                momentum: cfg.momentum,
                weight_decay: cfg.weight_decay,
            },
            params: template.params.clone(),
            params_behind: false,
            buffers: template.buffers.clone(),
            momentum: vec![0.0; template.params.len()],
        }
    }

    /// Rank 0: loads the checkpoint if there is one, refusing one that cannot belong to this run.
    pub(super) fn resume(
        &mut self,
        cfg: &TrainConfig,
        report: &mut dyn FnMut(Event),
    ) -> Result<bool> {
        // Read as the network it describes, so that another network is named, not just found
        // to lack a tensor.
        let Some(ckpt) = load_checkpoint(&cfg.checkpoint_file, None)? else {
            return Ok(false);
        };
        let saved = &ckpt.progress;
        let mismatch = |what: &str, saved: String, now: String| TrainError::BadCheckpoint {
            path: cfg.checkpoint_file.clone(),
            problem: format!(
                "was written for {what} {saved}, this run has {now}; it was not used: pass another --checkpoint-file (or --out) to start afresh"
            ),
        };
        let (was, now) = (&ckpt.info, &self.info);
        if was.architecture != now.architecture {
            return Err(mismatch(
                "the network",
                was.architecture.clone(),
                format!("--model {}", now.architecture),
            ));
        }
        if was.classes != now.classes {
            return Err(mismatch("classes", some(&was.classes), some(&now.classes)));
        }
        if was.image_size != now.image_size {
            return Err(mismatch(
                "images of",
                format!("{0}×{0}", was.image_size),
                format!("{0}×{0}", now.image_size),
            ));
        }
        if saved.dataset_len != self.progress.dataset_len {
            return Err(mismatch(
                "a training set of",
                saved.dataset_len.to_string(),
                self.progress.dataset_len.to_string(),
            ));
        }
        if saved.seed != cfg.seed {
            return Err(mismatch(
                "seed",
                saved.seed.to_string(),
                cfg.seed.to_string(),
            ));
        }
        for (name, was, now) in [
            ("batch size", saved.batch_size as f64, cfg.batch_size as f64),
            ("learning rate", saved.learning_rate, cfg.learning_rate),
            ("momentum", saved.momentum, cfg.momentum),
            ("weight decay", saved.weight_decay, cfg.weight_decay),
        ] {
            if was != now {
                report(Event::Warning(format!(
                    "checkpoint was trained with {name} {was}, continuing with {now}"
                )));
            }
        }
        if saved.epoch >= cfg.epochs && finished_run(cfg, saved.global_step) {
            if !cfg.train_again {
                return Err(TrainError::Finished {
                    path: cfg.checkpoint_file.clone(),
                    epochs: saved.epoch,
                    global_step: saved.global_step,
                    model: cfg.model_file.clone(),
                });
            }
            report(Event::Warning(format!(
                "{} holds a finished run ({} epochs, step {}): --train-again trains from scratch, replacing it and {}",
                cfg.checkpoint_file.display(),
                saved.epoch,
                saved.global_step,
                cfg.model_file.display()
            )));
            return Ok(false);
        }
        report(Event::Resumed {
            epoch: saved.epoch,
            position: saved.position,
            global_step: saved.global_step,
            saved_world_size: saved.world_size,
        });
        let world_size = self.progress.world_size;
        self.progress = Progress {
            world_size,
            batch_size: cfg.batch_size,
            learning_rate: cfg.learning_rate,
            momentum: cfg.momentum,
            weight_decay: cfg.weight_decay,
            ..ckpt.progress
        };
        self.params = ckpt.params;
        self.params_behind = false;
        self.buffers = ckpt.buffers;
        self.momentum = ckpt.momentum;
        Ok(true)
    }

    /// Whether this rank resumed and where training stands, as bytes for the broadcast: the
    /// flag, then epoch, position, global step, samples seen and the epoch's digest as whole
    /// little-endian u64s.
    pub(super) fn header(&self, resumed: bool) -> [u8; HEADER_BYTES] {
        let mut h = [0u8; HEADER_BYTES];
        h[0] = resumed as u8;
        for (i, v) in [
            self.progress.epoch as u64,
            self.progress.position as u64,
            self.progress.global_step,
            self.progress.samples_seen,
            self.progress.epoch_digest,
        ]
        .into_iter()
        .enumerate()
        {
            h[1 + 8 * i..9 + 8 * i].copy_from_slice(&v.to_le_bytes());
        }
        h
    }

    /// Takes rank 0's [`header`](Self::header); returns whether rank 0 resumed.
    pub(super) fn apply_header(&mut self, h: &[u8; HEADER_BYTES]) -> bool {
        let v = |i: usize| {
            let mut word = [0u8; 8];
            word.copy_from_slice(&h[1 + 8 * i..9 + 8 * i]);
            u64::from_le_bytes(word)
        };
        self.progress.epoch = v(0) as usize;
        self.progress.position = v(1) as usize;
        self.progress.global_step = v(2);
        self.progress.samples_seen = v(3);
        self.progress.epoch_digest = v(4);
        h[0] != 0
    }

    /// The flat parameters, as checkpoints, the regroup's broadcast and the model file carry them.
    ///
    /// # Panics
    /// While the model holds newer ones ([`Self::take_params`] first): old weights are never
    /// saved or sent.
    pub(super) fn params(&self) -> &[f32] {
        assert!(
            !self.params_behind,
            "the model holds newer parameters: take_params first"
        );
        &self.params
    }

    /// The flat parameters, to be replaced (a peer's, broadcast). Panics as [`Self::params`].
    pub(super) fn params_mut(&mut self) -> &mut [f32] {
        assert!(
            !self.params_behind,
            "the model holds newer parameters: take_params first"
        );
        &mut self.params
    }

    pub(super) fn param_count(&self) -> usize {
        // One momentum per parameter, whether or not `params` is behind (and emptied).
        self.momentum.len()
    }

    /// Reads the model's parameters back into the flat ones, if they are behind.
    pub(super) fn take_params<M: Net>(&mut self, model: &M) {
        if self.params_behind {
            self.params = snapshot(model).params;
            self.params_behind = false;
        }
    }

    /// PyTorch's SGD ([`kernels::sgd::step`]) with `cfg`'s hyper-parameters on the gradients
    /// `grads` times `grad_scale`, applied to the model's own tensors in place ([`sgd_step`]):
    /// the flat parameters are left behind.
    pub(super) fn sgd_step<M: Net>(
        &mut self,
        model: M,
        cfg: &TrainConfig,
        grads: StepGradients,
        grad_scale: f32,
    ) -> M {
        let sgd = Sgd {
            learning_rate: cfg.learning_rate as f32,
            momentum: cfg.momentum as f32,
            weight_decay: cfg.weight_decay as f32,
            first: self.progress.global_step == 0,
            grad_scale,
        };
        let model = sgd_step(model, &mut self.momentum, grads, sgd);
        self.params_behind = true;
        self.params = Vec::new();
        model
    }

    pub(super) fn snapshot(&self, template: &Snapshot) -> Snapshot {
        Snapshot {
            entries: template.entries.clone(),
            params: self.params().to_vec(),
            buffers: self.buffers.clone(),
        }
    }

    pub(super) fn checkpoint(
        &self,
        cfg: &TrainConfig,
        template: &Snapshot,
        rank: usize,
        recorder: &mut Recorder,
        report: &mut dyn FnMut(Event),
    ) -> Result<()> {
        if rank != 0 {
            return Ok(());
        }
        self.save(cfg, template, false, recorder, report)
    }

    /// Writes the checkpoint of this state; `if_newer`: only when the file holds an earlier
    /// step ([`save_checkpoint_if_newer`], as `collective::regroup::Save::IfNewer` asks).
    pub(super) fn save(
        &self,
        cfg: &TrainConfig,
        template: &Snapshot,
        if_newer: bool,
        recorder: &mut Recorder,
        report: &mut dyn FnMut(Event),
    ) -> Result<()> {
        let (file, snapshot) = (&cfg.checkpoint_file, self.snapshot(template));
        if if_newer {
            let wrote = save_checkpoint_if_newer(
                file,
                &snapshot,
                &self.momentum,
                &self.progress,
                &self.info,
            )?;
            if !wrote {
                return Ok(());
            }
        } else {
            save_checkpoint(file, &snapshot, &self.momentum, &self.progress, &self.info)?;
        }
        recorder.checkpoint(
            self.progress.global_step,
            self.progress.epoch,
            self.progress.position,
            report,
        );
        report(Event::CheckpointSaved {
            global_step: self.progress.global_step,
            epoch: self.progress.epoch,
            position: self.progress.position,
        });
        Ok(())
    }

    pub(super) fn fingerprint(&self) -> u32 {
        let mut h = crc32fast::Hasher::new();
        for v in self.params().iter().chain(&self.buffers) {
            h.update(&v.to_le_bytes());
        }
        h.finalize()
    }
}

/// A class list for a message: its length and the first few names.
fn some(classes: &[String]) -> String {
    let shown: Vec<&str> = classes.iter().take(4).map(String::as_str).collect();
    let more = if classes.len() > shown.len() {
        ", ..."
    } else {
        ""
    };
    format!("{} ({}{more})", classes.len(), shown.join(", "))
}

/// Whether the run whose checkpoint holds all its epochs at `global_step` also finished its
/// end: its model saved after that checkpoint and, when it evaluates, its evaluation recorded.
/// A run cut off in its end (a peer lost during the final evaluation) has not, and a restart
/// resumes it to finish that end.
fn finished_run(cfg: &TrainConfig, global_step: u64) -> bool {
    let modified = |path: &std::path::Path| std::fs::metadata(path).and_then(|m| m.modified());
    let model_saved = match (modified(&cfg.model_file), modified(&cfg.checkpoint_file)) {
        (Ok(model), Ok(checkpoint)) => model >= checkpoint,
        _ => false,
    };
    if !model_saved {
        return false;
    }
    if !cfg.evaluate {
        return true;
    }
    let metrics = telemetry::metrics::rank_file(&cfg.run_dir, 0);
    telemetry::metrics::read_metrics(&metrics).is_ok_and(|m| {
        m.records
            .iter()
            .any(|r| matches!(r, telemetry::metrics::Record::Eval(e) if e.step == global_step))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::ModelInfo;

    /// The header carries whole u64s: positions past 2^48 (which the old 16-bit float pieces
    /// dropped) and every bit of the flag come back exactly.
    #[test]
    fn the_resume_header_carries_whole_integers() {
        let progress = Progress {
            epoch: 7,
            position: (1 << 50) + 3,
            global_step: u64::MAX - 1,
            samples_seen: (1 << 48) + 1,
            epoch_digest: 0xDEAD_BEEF_0123_4567,
            ..crate::checkpoint::tests::progress()
        };
        let state = |progress: Progress| TrainState {
            progress,
            info: ModelInfo::seed_cifar(),
            params: vec![],
            params_behind: false,
            buffers: vec![],
            momentum: vec![],
        };
        let header = state(progress.clone()).header(true);
        let mut other = state(Progress {
            epoch: 0,
            position: 0,
            global_step: 0,
            samples_seen: 0,
            epoch_digest: 0,
            ..progress.clone()
        });
        assert!(other.apply_header(&header));
        assert_eq!(other.progress, progress);
        assert!(!other.apply_header(&state(progress).header(false)));
    }
}
