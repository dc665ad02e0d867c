"""trainctl.lightning's sampler (DistributedSampler's layout from a position) and its folder of
checkpoints (the newest step, rank 0's copy first). Skipped where lightning is not installed."""

import os
import tempfile
import unittest

try:
    import torch
    from torch.utils.data import DistributedSampler

    from trainctl import lightning
except ImportError:  # pragma: no cover - a Python without torch or lightning
    lightning = None  # type: ignore[assignment]


class _Position:
    """What ``_Exact`` tells a sampler: a position in one epoch."""

    def __init__(self, epoch: int = -1, consumed: int = 0, batches: int = 0):
        self.at = (epoch, consumed, batches)

    def resumed_at(self, epoch: int) -> tuple[int, int]:
        return (self.at[1], self.at[2]) if epoch == self.at[0] else (0, 0)

    def begin(self, sampler: object) -> None:
        pass


@unittest.skipIf(lightning is None, "no torch or lightning")
class SamplerTest(unittest.TestCase):
    def test_from_an_epochs_start_it_is_lightnings_distributed_sampler(self) -> None:
        for n, world in [(96, 2), (97, 3), (5, 4)]:
            for rank in range(world):
                ours = lightning._Sampler(_Position(), n, True, 7, world, rank, 4, epoch=3)
                theirs = DistributedSampler(range(n), num_replicas=world, rank=rank, shuffle=True, seed=7)
                theirs.set_epoch(3)
                self.assertEqual(list(ours), list(theirs), (n, world, rank))
                self.assertEqual(len(ours), len(theirs))

    def test_from_a_position_every_rank_of_another_world_trains_the_rest_once(self) -> None:
        n, batch = 100, 4
        order = lightning._Sampler(_Position(), n, True, 0, 1, 0, batch, epoch=2).order()
        for consumed, batches_before in [(24, 3), (99, 12), (100, 13)]:
            trained: list[int] = []
            lengths = set()
            for rank in range(3):
                s = lightning._Sampler(_Position(2, consumed, batches_before), n, True, 0, 3, rank, batch, epoch=2)
                trained += s.trained(s.shard.steps)
                # Lightning counts the batches trained before the position in the epoch's length.
                lengths.add(-(-len(s) // batch) - batches_before)
            self.assertEqual(sorted(trained), sorted(order[consumed:]))
            self.assertEqual(lengths, {s.shard.steps})


@unittest.skipIf(lightning is None, "no torch or lightning")
class FolderTest(unittest.TestCase):
    def test_the_newest_step_is_read_rank_0s_copy_first_and_older_steps_go(self) -> None:
        with tempfile.TemporaryDirectory() as root:
            folder = lightning._Folder(os.path.join(root, "trainctl"))
            self.assertIsNone(folder.newest())
            self.assertTrue(folder.write(4, 0, {"step": 4}))
            self.assertTrue(folder.write(8, 1, {"step": 8}))
            self.assertTrue(folder.write(8, 0, {"step": 8}))
            self.assertFalse(folder.write(8, 1, {"step": 8}), "rank 0's copy of the step is there")
            self.assertFalse(folder.write(6, 0, {"step": 6}), "an older step is never written")
            newest = folder.newest()
            assert newest is not None
            self.assertTrue(newest.endswith("step-0000000008-rank-0.ckpt"))
            self.assertEqual(torch.load(newest, weights_only=True), {"step": 8})
            names = sorted(n for n in os.listdir(folder.path) if n.endswith(".ckpt"))
            self.assertEqual(names, ["step-0000000008-rank-0.ckpt", "step-0000000008-rank-1.ckpt"])


if __name__ == "__main__":
    unittest.main()
