"""The straggler watch (``trainctl.stragglers``), as the Rust one's tests have it: a group's
start-up is no evidence, a node slow from the start is named after its warm-up and a window of
steps in a row, and two steps of noise are not."""

from __future__ import annotations

import unittest
from typing import Callable

from trainctl.stragglers import Times, Watch


def step(nodes: int, busy: Callable[[int], float]) -> list[Times]:
    return [(n, 0.01, busy(n)) for n in range(nodes)]


class WatchTest(unittest.TestCase):
    def test_start_up_noise_is_no_straggler_but_a_node_slow_from_the_start_is_one(self) -> None:
        w = Watch()
        for i in range(40):
            self.assertIsNone(w.step(step(3, lambda n, i=i: 0.4 if n == 0 and i < 6 else 0.1)), i)
        for i in range(20):
            self.assertIsNone(w.step(step(3, lambda n, i=i: 0.6 if n == 2 and 3 <= i < 5 else 0.1)), i)
        w = Watch()
        started = None
        for i in range(30):
            change = w.step(step(3, lambda n: 0.4 if n == 1 else 0.1))
            if change and change[0] == "started" and started is None:
                started = (i, change[1]["node"])
        self.assertEqual(started, (13, 1))

    def test_a_new_group_ends_the_straggler_and_warms_up_again(self) -> None:
        w = Watch()
        for _ in range(14):
            change = w.step(step(3, lambda n: 0.4 if n == 1 else 0.1))
        self.assertEqual(change[0], "started")
        self.assertEqual(w.step(step(2, lambda n: 0.1)), ("ended", 1, None))
        for i in range(5):
            self.assertIsNone(w.step(step(2, lambda n: 0.4 if n == 0 else 0.1)), i)


if __name__ == "__main__":
    unittest.main()
