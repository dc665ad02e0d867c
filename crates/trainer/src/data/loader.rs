//! The data loader: one thread walks a plan of batches in order, decoding each batch's images
//! in parallel on a pool of its own, and hands finished batches over a bounded channel, so
//! the next `prefetch` batches are ready while the current step computes.
//!
//! The loader's pool is not the training pool (rayon's global one): decoding never queues
//! behind a convolution, nor the reverse.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::thread::JoinHandle;

use rayon::prelude::*;

use super::Samples;
use super::augment::{Augment, sample_seed};

/// How batches are prepared.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LoaderOptions {
    /// Decoding threads.
    pub threads: usize,
    /// Batches prepared ahead of the one being trained on.
    pub prefetch: usize,
    pub augment: Augment,
    /// Run seed and epoch: with the sample index, they choose each image's augmentation.
    pub seed: u64,
    pub epoch: usize,
}

/// One batch, ready for the network.
#[derive(Debug, Default)]
pub(crate) struct Batch {
    /// `[images, 3, size, size]`, normalised.
    pub pixels: Vec<f32>,
    pub labels: Vec<i64>,
    /// Sample indices of the images in `pixels`, in order.
    pub indices: Vec<usize>,
    /// Images that could not be read (path, problem): left out of the batch.
    pub unreadable: Vec<(PathBuf, String)>,
}

pub(crate) struct Loader {
    batches: Option<Receiver<Batch>>,
    worker: Option<JoinHandle<()>>,
}

impl Loader {
    /// Starts preparing `plan` (batches of sample indices, in the order they will be asked
    /// for). Fails only if the decoding pool cannot be made.
    pub(crate) fn start(
        data: Arc<Samples>,
        plan: Vec<Vec<usize>>,
        opts: LoaderOptions,
    ) -> std::io::Result<Loader> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(opts.threads.max(1))
            .thread_name(|i| format!("loader-{i}"))
            .build()
            .map_err(std::io::Error::other)?;
        let (tx, rx) = sync_channel(opts.prefetch);
        let worker = std::thread::Builder::new()
            .name("loader".into())
            .spawn(move || prepare_all(&data, plan, &opts, &pool, tx))?;
        Ok(Loader {
            batches: Some(rx),
            worker: Some(worker),
        })
    }

    /// The next batch of the plan; `None` after the last.
    pub(crate) fn next_batch(&mut self) -> Option<Batch> {
        self.batches.as_ref()?.recv().ok()
    }
}

impl Drop for Loader {
    /// Hanging up makes the preparing thread's next send fail, and it returns: joined here.
    fn drop(&mut self) {
        drop(self.batches.take());
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
    }
}

fn prepare_all(
    data: &Samples,
    plan: Vec<Vec<usize>>,
    opts: &LoaderOptions,
    pool: &rayon::ThreadPool,
    tx: SyncSender<Batch>,
) {
    for indices in plan {
        let batch = pool.install(|| prepare(data, &indices, opts));
        if tx.send(batch).is_err() {
            return;
        }
    }
}

/// Decodes, augments and normalises the images of `indices` in parallel.
pub(crate) fn prepare(data: &Samples, indices: &[usize], opts: &LoaderOptions) -> Batch {
    let floats = data.image_floats();
    let mut pixels = vec![0.0f32; indices.len() * floats];
    let outcomes: Vec<Result<(), String>> = pixels
        .par_chunks_mut(floats)
        .zip(indices.par_iter())
        .map(|(out, &i)| data.fill(i, opts.augment, sample_seed(opts.seed, opts.epoch, i), out))
        .collect();
    if outcomes.iter().all(Result::is_ok) {
        return Batch {
            pixels,
            labels: indices.iter().map(|&i| data.label(i) as i64).collect(),
            indices: indices.to_vec(),
            unreadable: Vec::new(),
        };
    }
    let mut batch = Batch::default();
    for ((&i, outcome), image) in indices.iter().zip(outcomes).zip(pixels.chunks(floats)) {
        match outcome {
            Ok(()) => {
                batch.pixels.extend_from_slice(image);
                batch.labels.push(data.label(i) as i64);
                batch.indices.push(i);
            }
            Err(problem) => {
                let path = data.path(i).map(|p| p.to_path_buf()).unwrap_or_default();
                batch.unreadable.push((path, problem));
            }
        }
    }
    batch
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::data::synthetic::{FolderSpec, write_folder};
    use crate::data::{Layout, Split};

    fn data(dir: &std::path::Path) -> Arc<Samples> {
        let spec = FolderSpec {
            classes: 3,
            train_per_class: 5,
            val_per_class: 0,
            size: 16,
            tiny_layout: false,
            seed: 2,
        };
        write_folder(dir, &spec).unwrap();
        let layout = Layout::locate(dir).unwrap();
        Arc::new(layout.open(Split::Train, 16, 1 << 20).unwrap())
    }

    fn options(threads: usize) -> LoaderOptions {
        LoaderOptions {
            threads,
            prefetch: 2,
            augment: Augment::Crop,
            seed: 9,
            epoch: 1,
        }
    }

    /// Batches come in the plan's order with the same pixels whatever the number of decoding
    /// threads; an unreadable image is left out and named.
    #[test]
    fn batches_follow_the_plan_whatever_the_threads() {
        let dir = tempfile::tempdir().unwrap();
        let data = data(dir.path());
        let plan = vec![vec![14, 0, 7], vec![3], vec![5, 6, 8, 9]];
        let run = |threads| {
            let mut loader =
                Loader::start(Arc::clone(&data), plan.clone(), options(threads)).unwrap();
            std::iter::from_fn(|| loader.next_batch()).collect::<Vec<_>>()
        };
        let one = run(1);
        let three = run(3);
        assert_eq!(one.len(), 3);
        for (a, b) in one.iter().zip(&three) {
            assert_eq!(a.indices, b.indices);
            assert_eq!(a.labels, b.labels);
            assert_eq!(a.pixels, b.pixels);
        }
        assert_eq!(one[0].indices, [14, 0, 7]);
        assert_eq!(one[0].labels, [2, 0, 1]);

        let broken = data.path(6).unwrap().to_path_buf();
        let fresh_dir = tempfile::tempdir().unwrap();
        let fresh = self::data(fresh_dir.path());
        std::fs::write(fresh.path(6).unwrap(), b"garbage").unwrap();
        let batch = prepare(&fresh, &[5, 6, 8], &options(2));
        assert_eq!(batch.indices, [5, 8]);
        assert_eq!(batch.pixels.len(), 2 * 3 * 16 * 16);
        assert_eq!(batch.unreadable.len(), 1);
        assert!(
            batch.unreadable[0]
                .0
                .ends_with(broken.strip_prefix(dir.path()).unwrap())
        );
    }

    /// Dropping a loader mid-plan stops its thread and joins it, rather than decoding the
    /// rest of the plan or blocking on the full channel forever.
    #[test]
    fn a_dropped_loader_stops() {
        let dir = tempfile::tempdir().unwrap();
        let data = data(dir.path());
        let plan = vec![vec![0]; 1_000_000];
        let mut loader = Loader::start(data, plan, options(1)).unwrap();
        assert!(loader.next_batch().is_some());
        let (done, dropped) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            drop(loader);
            let _ = done.send(());
        });
        assert!(
            dropped
                .recv_timeout(std::time::Duration::from_secs(30))
                .is_ok(),
            "dropping the loader did not return"
        );
    }
}
