//! Everything a checkpoint holds, as flat buffers, and what is done to it: fresh start,
//! resume (refusing a checkpoint of another run), the broadcast header, the SGD update.

use crate::checkpoint::{ModelInfo, Progress, load_checkpoint, save_checkpoint};
use crate::error::{Result, TrainError};
use crate::model::Snapshot;
use crate::record::Recorder;

use super::{Event, TrainConfig};

/// Everything a checkpoint holds, as flat buffers.
pub(super) struct TrainState {
    pub(super) progress: Progress,
    pub(super) info: ModelInfo,
    pub(super) params: Vec<f32>,
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
                seed: cfg.seed,
                world_size,
                dataset_len,
                batch_size: cfg.batch_size,
                learning_rate: cfg.learning_rate,
                momentum: cfg.momentum,
                weight_decay: cfg.weight_decay,
            },
            params: template.params.clone(),
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
        self.buffers = ckpt.buffers;
        self.momentum = ckpt.momentum;
        Ok(true)
    }

    /// The position as floats for the broadcast: each integer in exact 16-bit pieces.
    pub(super) fn header(&self, resumed: bool) -> Vec<f32> {
        let mut h = vec![resumed as u8 as f32];
        for v in [
            self.progress.epoch as u64,
            self.progress.position as u64,
            self.progress.global_step,
            self.progress.samples_seen,
        ] {
            h.extend([(v >> 32) & 0xffff, (v >> 16) & 0xffff, v & 0xffff].map(|p| p as f32));
        }
        h
    }

    pub(super) fn apply_header(&mut self, h: &[f32]) -> bool {
        let v = |i: usize| ((h[i] as u64) << 32) | ((h[i + 1] as u64) << 16) | h[i + 2] as u64;
        self.progress.epoch = v(1) as usize;
        self.progress.position = v(4) as usize;
        self.progress.global_step = v(7);
        self.progress.samples_seen = v(10);
        h[0] != 0.0
    }

    /// PyTorch's SGD: d = g + wd·p; buf = d on the first step, else momentum·buf + d; p -= lr·buf.
    pub(super) fn sgd_step(&mut self, cfg: &TrainConfig, grads: &[f32]) {
        let (lr, mu, wd) = (
            cfg.learning_rate as f32,
            cfg.momentum as f32,
            cfg.weight_decay as f32,
        );
        let first = self.progress.global_step == 0;
        for ((p, b), g) in self
            .params
            .iter_mut()
            .zip(self.momentum.iter_mut())
            .zip(grads)
        {
            let d = g + wd * *p;
            *b = if first || mu == 0.0 { d } else { mu * *b + d };
            *p -= lr * *b;
        }
    }

    pub(super) fn snapshot(&self, template: &Snapshot) -> Snapshot {
        Snapshot {
            entries: template.entries.clone(),
            params: self.params.clone(),
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
        save_checkpoint(
            &cfg.checkpoint_file,
            &self.snapshot(template),
            &self.momentum,
            &self.progress,
            &self.info,
        )?;
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
        for v in self.params.iter().chain(&self.buffers) {
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
