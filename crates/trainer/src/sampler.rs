//! Distributed sampling with torch's `DistributedSampler` semantics (shuffle by seed + epoch,
//! pad to a multiple of the world size, rank `r` takes every world-size-th index starting at
//! `r`), plus a position inside the epoch so training can resume mid-epoch at any world size.
//!
//! Invariant: after `k` steps of batch `b` on a world of `w`, exactly the first
//! `min(k*b*w, remaining)` indices of the epoch's remaining order have been consumed, whatever
//! `w` is. That is what makes re-sharding after a restart lose and repeat nothing.

/// The epoch's order of `n` samples, a permutation fixed by `seed` and `epoch`.
pub(crate) fn epoch_order(n: usize, seed: u64, epoch: usize) -> Vec<usize> {
    let mut rng = SplitMix64(seed ^ (epoch as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let mut order: Vec<usize> = (0..n).collect();
    for i in (1..n).rev() {
        let j = (rng.next() % (i as u64 + 1)) as usize;
        order.swap(i, j);
    }
    order
}

/// Where one rank stands in one epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Shard {
    /// This rank's indices for the rest of the epoch, in order.
    pub indices: Vec<usize>,
    pub batch_size: usize,
    /// Samples of the epoch consumed before this shard started (global count).
    pub start: usize,
    pub world_size: usize,
    /// Samples in the whole epoch.
    pub epoch_len: usize,
    /// How many of `indices` are the epoch's own; the rest repeat samples to pad the epoch's
    /// rest to a multiple of the world size, as torch's `DistributedSampler` does.
    pub unpadded: usize,
}

impl Shard {
    /// Rank `rank`'s share of epoch `epoch` from position `consumed` on.
    pub(crate) fn new(
        n: usize,
        seed: u64,
        epoch: usize,
        consumed: usize,
        world_size: usize,
        rank: usize,
        batch_size: usize,
    ) -> Shard {
        Shard::of(
            &epoch_order(n, seed, epoch),
            consumed,
            world_size,
            rank,
            batch_size,
        )
    }

    /// Rank `rank`'s share of the rest of an epoch whose order is `order`, from position
    /// `consumed` on (the Python package's `Shard`, whose order is torch's: the two follow the
    /// shared cases of `vectors/sampler.json`).
    pub(crate) fn of(
        order: &[usize],
        consumed: usize,
        world_size: usize,
        rank: usize,
        batch_size: usize,
    ) -> Shard {
        assert!(world_size > 0 && rank < world_size && batch_size > 0);
        let n = order.len();
        let rest = &order[consumed.min(n)..];
        let per_rank = rest.len().div_ceil(world_size);
        let indices = (0..per_rank)
            .map(|k| rest[(k * world_size + rank) % rest.len()])
            .collect();
        Shard {
            indices,
            batch_size,
            start: consumed.min(n),
            world_size,
            epoch_len: n,
            unpadded: rest.len().saturating_sub(rank).div_ceil(world_size),
        }
    }

    /// Steps left in the epoch (the last batch may be short).
    pub(crate) fn steps(&self) -> usize {
        self.indices.len().div_ceil(self.batch_size)
    }

    pub(crate) fn batch(&self, step: usize) -> &[usize] {
        let lo = (step * self.batch_size).min(self.indices.len());
        let hi = ((step + 1) * self.batch_size).min(self.indices.len());
        &self.indices[lo..hi]
    }

    /// The samples of `batch(step)` that are not padding: what the epoch's
    /// [`digest`] counts, so that an epoch that trained each sample once has the digest of all
    /// its samples whatever the world sizes it ran at.
    pub(crate) fn unpadded_batch(&self, step: usize) -> &[usize] {
        let lo = (step * self.batch_size).min(self.unpadded);
        let hi = ((step + 1) * self.batch_size).min(self.unpadded);
        &self.indices[lo..hi]
    }

    /// The epoch position (global samples consumed) once `steps_done` steps of this shard ran.
    pub(crate) fn position_after(&self, steps_done: usize) -> usize {
        (self.start + steps_done * self.batch_size * self.world_size).min(self.epoch_len)
    }
}

/// Of `unpadded` (a step's samples without padding: the start of the batch the loader was
/// given), those the loader delivered: `delivered` holds the batch's samples in order, with
/// unreadable images left out.
pub(crate) fn delivered(unpadded: &[usize], delivered: &[usize]) -> Vec<usize> {
    let mut next = delivered.iter().peekable();
    unpadded
        .iter()
        .filter(|&&id| next.next_if(|&&d| d == id).is_some())
        .copied()
        .collect()
}

/// Samples as one number, whatever their order: the wrapping sum of a 64-bit mix of each sample
/// id. Two runs that trained the same samples of an epoch, each as many times, have the same
/// digest; a sample lost, added or trained twice changes it. Sums of digests are the digest of
/// the union, so ranks' and steps' digests add up to the epoch's. The trainer digests
/// [`Shard::unpadded_batch`]es.
pub fn digest(ids: &[usize]) -> u64 {
    ids.iter().fold(0u64, |acc, &id| {
        acc.wrapping_add(SplitMix64(id as u64).next())
    })
}

/// splitmix64: tiny, fast and fixed forever, so an epoch's order never changes between releases.
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    /// The shared cases (`vectors/sampler.json` at the repository's root), which the Python
    /// package's sampler is checked against too (python/tests/test_vectors.py).
    #[test]
    fn shards_and_digests_follow_the_shared_cases() {
        #[derive(serde::Deserialize)]
        struct ShardIn {
            order: Vec<usize>,
            consumed: usize,
            world_size: usize,
            rank: usize,
            batch_size: usize,
        }
        #[derive(serde::Deserialize)]
        struct ShardOut {
            indices: Vec<usize>,
            unpadded: usize,
            steps: usize,
            batches: Vec<Vec<usize>>,
            unpadded_batches: Vec<Vec<usize>>,
            positions_after: Vec<usize>,
        }
        #[derive(serde::Deserialize)]
        struct ShardCase {
            #[serde(rename = "in")]
            input: ShardIn,
            out: ShardOut,
        }
        #[derive(serde::Deserialize)]
        struct DigestCase {
            ids: Vec<usize>,
            digest: u64,
        }
        #[derive(serde::Deserialize)]
        struct Vectors {
            shard: Vec<ShardCase>,
            digest: Vec<DigestCase>,
        }
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../vectors/sampler.json");
        let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{path}: {e}"));
        let v: Vectors = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: {e}"));
        assert!(!v.shard.is_empty() && !v.digest.is_empty());
        for ShardCase { input: i, out } in v.shard {
            let s = Shard::of(&i.order, i.consumed, i.world_size, i.rank, i.batch_size);
            let case = format!(
                "{} samples from {}, rank {} of {}, batch {}",
                i.order.len(),
                i.consumed,
                i.rank,
                i.world_size,
                i.batch_size
            );
            assert_eq!(s.indices, out.indices, "{case}");
            assert_eq!((s.unpadded, s.steps()), (out.unpadded, out.steps), "{case}");
            let batches: Vec<&[usize]> = (0..s.steps()).map(|k| s.batch(k)).collect();
            assert_eq!(batches, out.batches, "{case}");
            let unpadded: Vec<&[usize]> = (0..s.steps()).map(|k| s.unpadded_batch(k)).collect();
            assert_eq!(unpadded, out.unpadded_batches, "{case}");
            let positions: Vec<usize> = (0..=s.steps()).map(|k| s.position_after(k)).collect();
            assert_eq!(positions, out.positions_after, "{case}");
        }
        for c in v.digest {
            assert_eq!(digest(&c.ids), c.digest, "digest of {:?}", c.ids);
        }
    }

    /// Unreadable images (left out of what the loader delivered) and padding (after the
    /// unpadded part, possibly repeating its samples) are not counted as trained.
    #[test]
    fn delivered_leaves_out_unreadable_images_and_padding() {
        // Batch [5, 7, 5]: the last 5 is padding.
        assert_eq!(delivered(&[5, 7], &[5, 7, 5]), [5, 7]);
        assert_eq!(delivered(&[5, 7], &[7]), [7], "5 unreadable, padding too");
        assert_eq!(delivered(&[5, 7], &[5, 5]), [5], "7 unreadable");
        assert_eq!(delivered(&[5, 7], &[]), [] as [usize; 0]);
    }

    #[test]
    fn the_order_depends_on_seed_and_epoch_only() {
        assert_eq!(epoch_order(100, 1, 3), epoch_order(100, 1, 3));
        assert_ne!(epoch_order(100, 1, 3), epoch_order(100, 1, 4));
        assert_ne!(epoch_order(100, 1, 3), epoch_order(100, 2, 3));
        let mut sorted = epoch_order(100, 1, 3);
        sorted.sort();
        assert_eq!(sorted, (0..100).collect::<Vec<_>>());
    }

    #[test]
    fn a_digest_sees_a_lost_or_repeated_sample_but_not_the_order() {
        let epoch = epoch_order(50, 7, 1);
        let whole = digest(&epoch);
        let mut reversed = epoch.clone();
        reversed.reverse();
        assert_eq!(digest(&reversed), whole, "order does not matter");
        let (a, b) = epoch.split_at(17);
        assert_eq!(digest(a).wrapping_add(digest(b)), whole, "parts add up");
        assert_ne!(digest(&epoch[1..]), whole, "a sample lost");
        let mut twice = epoch.clone();
        twice.push(epoch[3]);
        assert_ne!(digest(&twice), whole, "a sample trained twice");
    }

    proptest! {
        #[test]
        fn shards_are_disjoint_equal_and_cover_the_epoch(n in 1usize..300, world in 1usize..6, batch in 1usize..40, seed in any::<u64>()) {
            let shards: Vec<Shard> = (0..world).map(|r| Shard::new(n, seed, 0, 0, world, r, batch)).collect();
            let len = shards[0].indices.len();
            prop_assert!(shards.iter().all(|s| s.indices.len() == len), "equal shards");
            prop_assert_eq!(len, n.div_ceil(world));
            let all: HashSet<usize> = shards.iter().flat_map(|s| s.indices.iter().copied()).collect();
            prop_assert_eq!(all.len(), n, "every sample is used");
            if n % world == 0 {
                prop_assert_eq!(shards.iter().map(|s| s.indices.len()).sum::<usize>(), n, "no padding when it divides");
            }
        }

        #[test]
        fn resuming_at_another_world_size_neither_loses_nor_repeats(
            n in 1usize..400, w1 in 1usize..5, w2 in 1usize..5, batch in 1usize..20, seed in any::<u64>(), cut in 0usize..50,
        ) {
            // Run `cut` steps at world w1, then the rest of the epoch at world w2.
            let first: Vec<Shard> = (0..w1).map(|r| Shard::new(n, seed, 2, 0, w1, r, batch)).collect();
            let steps = cut.min(first[0].steps());
            let mut seen: Vec<usize> = first.iter().flat_map(|s| (0..steps).flat_map(|k| s.batch(k).to_vec())).collect();
            let position = first[0].position_after(steps);
            let second: Vec<Shard> = (0..w2).map(|r| Shard::new(n, seed, 2, position, w2, r, batch)).collect();
            seen.extend(second.iter().flat_map(|s| s.indices.iter().copied()));
            let distinct: HashSet<usize> = seen.iter().copied().collect();
            prop_assert_eq!(distinct.len(), n, "nothing lost");
            // Without the padding, each sample exactly once, whatever the two world sizes.
            let unpadded = first
                .iter()
                .map(|s| (0..steps).map(|k| digest(s.unpadded_batch(k))).fold(0u64, u64::wrapping_add))
                .chain(second.iter().map(|s| (0..s.steps()).map(|k| digest(s.unpadded_batch(k))).fold(0u64, u64::wrapping_add)))
                .fold(0u64, u64::wrapping_add);
            prop_assert_eq!(unpadded, digest(&(0..n).collect::<Vec<_>>()), "each sample once");
            // Repeats come only from padding: at most world-1 per phase.
            prop_assert!(seen.len() <= n + (w1 - 1) + (w2 - 1), "{} samples for {}", seen.len(), n);
        }
    }
}
