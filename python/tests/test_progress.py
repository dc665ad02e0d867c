"""Where a run stands (``Progress``): what travels with the state and into the checkpoint."""

from __future__ import annotations

import unittest

from trainctl.torch._progress import Progress


class ProgressTest(unittest.TestCase):
    def test_it_travels_as_a_dict_and_back(self) -> None:
        p = Progress(epoch=2, position=96, global_step=40, samples_seen=736, epoch_digest=7, world_size=3)
        self.assertEqual(Progress.from_dict(p.to_dict()), p)

    def test_an_older_checkpoints_missing_fields_take_their_defaults(self) -> None:
        p = Progress.from_dict({"epoch": 1, "position": 32, "global_step": 9, "samples_seen": 320})
        self.assertEqual((p.epoch, p.global_step, p.world_size, p.epoch_end_evals), (1, 9, 0, -1))

    def test_the_next_epoch_starts_from_its_start_and_keeps_the_counts(self) -> None:
        p = Progress(epoch=0, position=320, global_step=10, samples_seen=320, epoch_digest=5, epoch_end_evals=2)
        p.next_epoch()
        self.assertEqual(p, Progress(epoch=1, global_step=10, samples_seen=320))


if __name__ == "__main__":
    unittest.main()
