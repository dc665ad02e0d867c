"""The loop's epoch as its batch iterators walk it: the rest of the epoch planned for this rank
(again after a regroup), one micro-batch handed at a time with a boundary after each, and the
epoch's batches' end (its record, whose digest proves each sample was trained once)."""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator

from . import _data
from ._errors import UsageError
from ._flow import Flow
from ._membership import Place
from ._records import Records
from ._state import TrainingState
from ._step import Stepper


class Epoch:
    """See the module's doc (``_data.Epoch``, which the iterators ask)."""

    def __init__(
        self,
        plan: _data.Plan,
        state: TrainingState,
        place: Place,
        stepper: Stepper,
        flow: Flow,
        records: Records,
        boundary: Callable[[], Any],
    ):
        self.plan, self.state, self.place, self.stepper = plan, state, place, stepper
        self.flow, self.records, self.boundary = flow, records, boundary
        self.total = 0
        # The plan being trained and the place in it of the micro-batch handed to the loop.
        self.current: tuple[list[_data.Micro], int] = ([], 0)
        # The epoch under way and when it began.
        self._mark: tuple[int, float] | None = None

    def planned(self) -> list[_data.Micro]:
        """The rest of the epoch's micro-batches for this rank."""
        place = self.place
        return self.plan.rest(self.state.progress, place.world_size, place.rank, place.generation)

    def iterate(self, on_plan: Callable[[list[_data.Micro]], None] | None = None) -> Iterator[_data.Micro]:
        """The rest of the epoch, one micro-batch at a time, with a boundary after each; planned
        again after a regroup."""
        stepper = self.stepper
        stepper.handed = None
        self.boundary()
        self._begin()
        while True:
            planned = self.planned()
            if not planned:
                self.batches_ended()
                return
            if on_plan is not None:
                on_plan(planned)
            generation = self.place.generation
            for i, micro in enumerate(planned):
                stepper.handed = micro
                self.current = (planned, i)
                yield micro
                if stepper.handed is not None:
                    raise UsageError(
                        "the next batch was asked for before this one was trained: a DataLoader with "
                        "worker processes reads job.batches() ahead, and a regroup would re-plan the "
                        "epoch under it. Use job.loader(dataset, num_workers=..., ...) (the "
                        "DataLoader's own arguments; it drops what it read ahead when the group "
                        "changes), or num_workers=0; and train every batch inside `with job.step():`"
                    )
                self.boundary()
                if self.place.generation != generation:
                    break

    def _begin(self) -> None:
        """Marks the epoch's start (once), and the global step its counter runs from."""
        p = self.state.progress
        if self._mark is None or self._mark[0] != p.epoch:
            self._mark = (p.epoch, time.monotonic())
            done = self.plan.steps_done(p, self.place.world_size)
            self.stepper.epoch_first_step = p.global_step - done

    def batches_ended(self) -> None:
        """The epoch's batches are all trained: its record, once."""
        came_in_here = self.flow.evaluate_from == "batches"
        self.flow.batches_ended()
        p = self.state.progress
        if p.epoch_end_evals >= 0:
            if came_in_here:
                # Its evaluations count from here, as the others' did (see Flow).
                p.epoch_end_evals = 0
            return
        p.epoch_end_evals = 0
        started = self._mark[1] if self._mark else time.monotonic()
        self.records.epoch(self.place.rank, p, time.monotonic() - started, self.total)
