"""Where a rank stands, in the loop's own code between steps, against the others of its group:
which of the loop's ``job.evaluate()`` and ``scheduler.step()`` calls run on it.

A rank that joined (or resumed mid-epoch) runs the loop from its top; the others made the
calls before the point where it came in, so it skips them. When a newcomer comes in while
the others are between steps, they skip the evaluations it cannot be part of (``fn`` would
wait for it). Pure: ``Elastic`` tells it what happened, and asks.
"""

from __future__ import annotations


class Flow:
    """See the module's doc."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """A new epoch: every rank at its start, alike."""
        # The last `with job.step()` applied no update (dropped, a micro-batch before its
        # step's last, or none yet on a rank that came in mid-loop): scheduler.step() waits.
        self.void = False
        # None: evaluations run. "step": none until an update is applied. "batches": none until
        # the epoch's batches end, then `skip` more.
        self.evaluate_from: str | None = None
        self.skip = 0

    def came_in(self, epoch_complete: bool, begun: int) -> None:
        """This rank took a state mid-loop: at a step boundary, or with its epoch's batches
        done and ``begun`` evaluations begun since."""
        self.void = True
        self.evaluate_from = "batches" if epoch_complete else "step"
        self.skip = begun if epoch_complete else 0

    def newcomer_arrived(self, epoch_complete: bool) -> None:
        """A rank came into this rank's group while it was between steps: the evaluation under
        way is dropped, and mid-epoch every evaluation until the next step."""
        self.evaluate_from = None if epoch_complete else "step"
        self.skip = 0

    def step_ended(self, applied: bool) -> None:
        self.void = not applied
        if applied and self.evaluate_from == "step":
            self.evaluate_from = None

    def batches_ended(self) -> None:
        self.void = False
        if self.evaluate_from == "batches":
            self.evaluate_from = None

    def evaluation_runs(self) -> bool:
        if self.evaluate_from is not None:
            return False
        if self.skip:
            self.skip -= 1
            return False
        return True
