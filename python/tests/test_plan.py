"""The epoch planned as micro-batches from a position every rank agrees on (``_data.plan``)."""

import itertools
import random
import unittest

from trainctl.torch._data import BLOCKS, plan


class PlanTest(unittest.TestCase):
    def test_every_sample_left_is_trained_once_whatever_the_world_and_accumulation(self) -> None:
        rng = random.Random(7)
        shapes = itertools.product([1, 7, 64, 100], [1, 2, 3, 5], [1, 4, 8], [1, 2, 3], ["interleaved", BLOCKS])
        for n, world, batch, accumulate, layout in shapes:
            order = list(range(n))
            rng.shuffle(order)
            position = rng.randrange(n + 1)
            plans = [plan(order, position, world, r, batch, accumulate, 0, layout) for r in range(world)]
            trained = sorted(i for p in plans for m in p for i in m.trained)
            self.assertEqual(trained, sorted(order[position:]), (n, world, batch, accumulate, position))
            # Every rank has as many micro-batches, each step as many parts, each part at most
            # `batch` samples, and the step's end position is every rank's.
            self.assertEqual(len({len(p) for p in plans}), 1)
            for parts in zip(*plans):
                self.assertEqual(len({(m.part, m.parts, m.position_after) for m in parts}), 1)
                self.assertTrue(all(0 < len(m.indices) <= batch for m in parts))
            for m in plans[0]:
                self.assertEqual(m.last, m.part == m.parts - 1)

    def test_a_step_is_batch_times_accumulate_samples_per_rank(self) -> None:
        p = plan(list(range(40)), 0, 2, 0, 4, 3, 5)
        self.assertEqual([(m.part, m.parts) for m in p[:3]], [(0, 3), (1, 3), (2, 3)])
        self.assertEqual(p[2].position_after, 24)
        self.assertEqual(p[0].generation, 5)
        self.assertEqual(p[0].indices, [0, 2, 4, 6])

    def test_blocks_split_a_step_as_accelerate_does_and_train_the_same_samples(self) -> None:
        # accelerate's split: micro-batch p of a step, rank r: the (p * world + r)-th block of
        # `batch` samples of the step's slice of the order.
        order = list(range(100, 148))
        p = [plan(order, 4, 2, r, 4, 2, 0, BLOCKS) for r in range(2)]
        self.assertEqual(p[0][0].indices, [104, 105, 106, 107])
        self.assertEqual(p[1][0].indices, [108, 109, 110, 111])
        self.assertEqual(p[0][1].indices, [112, 113, 114, 115])
        self.assertEqual(p[1][1].indices, [116, 117, 118, 119])
        # Each step trains the same samples as the interleaved layout's, to the same position.
        interleaved = [plan(order, 4, 2, r, 4, 2, 0) for r in range(2)]
        for step in range(len(p[0]) // 2):
            parts = slice(2 * step, 2 * step + 2)
            blocks = sorted(i for q in p for m in q[parts] for i in m.trained)
            spread = sorted(i for q in interleaved for m in q[parts] for i in m.trained)
            self.assertEqual(blocks, spread, step)
            self.assertEqual(p[0][parts][-1].position_after, interleaved[0][parts][-1].position_after)

    def test_a_finished_epoch_plans_nothing(self) -> None:
        self.assertEqual(plan(list(range(10)), 10, 2, 1, 4, 1, 0), [])


if __name__ == "__main__":
    unittest.main()
