"""Where a rank stands between steps against the others (``Flow``): which of the loop's
``job.evaluate()`` and ``scheduler.step()`` calls run on it."""

from __future__ import annotations

import unittest

from trainctl.torch._flow import Flow


def runs(flow: Flow, n: int) -> list[bool]:
    return [flow.evaluation_runs() for _ in range(n)]


class FlowTest(unittest.TestCase):
    def test_a_rank_that_trains_along_runs_every_evaluation_and_scheduler_step(self) -> None:
        flow = Flow()
        self.assertEqual(runs(flow, 3), [True] * 3)
        flow.step_ended(applied=True)
        self.assertFalse(flow.void)

    def test_a_dropped_step_or_a_micro_batch_holds_the_scheduler_until_an_update(self) -> None:
        flow = Flow()
        flow.step_ended(applied=False)
        self.assertTrue(flow.void)
        flow.step_ended(applied=True)
        self.assertFalse(flow.void)

    def test_a_rank_that_came_in_mid_epoch_skips_until_its_first_update(self) -> None:
        flow = Flow()
        flow.came_in(epoch_complete=False, begun=3)
        # The epoch's start code it runs, which the others ran before it came in.
        self.assertTrue(flow.void)
        self.assertEqual(runs(flow, 2), [False, False])
        flow.step_ended(applied=False)
        self.assertEqual(runs(flow, 1), [False])
        flow.step_ended(applied=True)
        self.assertFalse(flow.void)
        self.assertEqual(runs(flow, 2), [True, True])

    def test_a_rank_that_came_in_at_an_epochs_end_skips_what_the_others_began(self) -> None:
        flow = Flow()
        flow.came_in(epoch_complete=True, begun=2)
        self.assertEqual(runs(flow, 2), [False, False])  # the epoch's start code
        flow.batches_ended()
        self.assertFalse(flow.void, "the epoch's end code steps the scheduler with the others")
        # The two the others began before it came in (the second dropped on them too).
        self.assertEqual(runs(flow, 4), [False, False, True, True])

    def test_the_others_skip_the_evaluation_a_newcomer_arrived_in(self) -> None:
        mid = Flow()
        mid.newcomer_arrived(epoch_complete=False)
        self.assertEqual(runs(mid, 2), [False, False])
        mid.step_ended(applied=True)
        self.assertEqual(runs(mid, 1), [True])
        end = Flow()
        end.newcomer_arrived(epoch_complete=True)
        self.assertEqual(runs(end, 2), [True, True], "the next ones have the newcomer")


if __name__ == "__main__":
    unittest.main()
