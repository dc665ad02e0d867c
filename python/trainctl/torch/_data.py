"""What a rank trains next: the rest of the epoch as micro-batches, planned from the position
every rank agrees on, and the two ways a training loop reads them (``job.batches()``, sample
indices; ``job.loader(dataset)``, a DataLoader's batches).

A step is ``accumulate`` micro-batches of ``batch_size`` samples per rank. The plan is
re-made after every regroup (another world size re-shards the rest of the epoch), so a loop
must not read ahead of training: ``job.batches()`` refuses a reader that does (a DataLoader
with worker processes prefetches), and ``job.loader()`` is the DataLoader that can be read
ahead, because it drops what it prefetched when the plan changes.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator, NamedTuple, Protocol

import torch
from torch.utils.data import DataLoader, IterableDataset

from ..sampler import Shard
from ._errors import UsageError
from ._progress import Progress

# DataLoader arguments the job decides: which samples each batch holds, and in what order.
_PLANNED = ("batch_size", "shuffle", "sampler", "batch_sampler", "drop_last")


class Micro(NamedTuple):
    """One micro-batch of this rank's plan."""

    generation: int
    """The group it was planned for (a regroup makes the rest of the plan stale)."""
    part: int
    """Its place in its step, from 0; the step's optimizer update follows part ``parts - 1``."""
    parts: int
    indices: list[int]
    """This rank's samples, padding included (DistributedSampler pads the epoch's end)."""
    trained: list[int]
    """The epoch's own samples among them: what the step's digest counts."""
    position_after: int
    """The epoch's global position once its step is done."""

    @property
    def last(self) -> bool:
        return self.part == self.parts - 1


INTERLEAVED, BLOCKS = "interleaved", "blocks"
"""How a step's samples are split over the ranks. Either way a step trains the same slice of
the epoch's order (``batch_size * accumulate * world_size`` samples from its position), so
positions, digests and re-sharding are the same: ``interleaved`` is DistributedSampler's
(rank ``r`` takes every world-size-th sample), ``blocks`` is accelerate's (micro-batch ``p``
of a step: rank ``r`` takes the ``p * world_size + r``-th block of ``batch_size``), which the
Hugging Face Trainer's loop trains. A step short of samples at the epoch's end is split as
``interleaved`` in both (with its padding)."""


def plan(
    order: list[int],
    position: int,
    world_size: int,
    rank: int,
    batch_size: int,
    accumulate: int,
    generation: int,
    layout: str = INTERLEAVED,
) -> list[Micro]:
    """The rest of the epoch for ``rank`` of ``world_size``: each step's batch
    (``batch_size * accumulate`` samples, the last one maybe fewer) cut into micro-batches of
    ``batch_size``. Every rank's step has as many micro-batches: the sampler pads each rank's
    share to the same length."""
    shard = Shard(order, position, world_size, rank, batch_size * accumulate)
    step_len = batch_size * accumulate * world_size
    out = []
    for s in range(shard.steps):
        batch = shard.batch(s)
        own = len(shard.unpadded_batch(s))
        parts = -(-len(batch) // batch_size)
        after = shard.position_after(s + 1)
        first = shard.start + s * step_len
        whole = first + step_len <= shard.epoch_len
        for p in range(parts):
            if layout == BLOCKS and whole:
                lo = first + (p * world_size + rank) * batch_size
                block = list(order[lo : lo + batch_size])
                out.append(Micro(generation, p, parts, block, block, after))
                continue
            lo, hi = p * batch_size, min((p + 1) * batch_size, len(batch))
            out.append(Micro(generation, p, parts, batch[lo:hi], batch[lo : min(hi, max(own, lo))], after))
    return out


class Plan:
    """The epochs' order (``torch.randperm`` seeded by seed + epoch, as DistributedSampler's)
    and the rest of an epoch's micro-batches for a rank, from where the run stands."""

    def __init__(self, dataset_size: int, seed: int, batch_size: int, accumulate: int, layout: str = INTERLEAVED):
        if layout not in (INTERLEAVED, BLOCKS):
            raise ValueError(f"layout {layout!r}: choose {INTERLEAVED!r} or {BLOCKS!r}")
        self.dataset_size = dataset_size
        self.seed = seed
        self.batch_size = batch_size
        self.accumulate = accumulate
        self.layout = layout
        self._order: tuple[int, list[int]] | None = None

    def order(self, epoch: int) -> list[int]:
        if self._order is None or self._order[0] != epoch:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            self._order = (epoch, torch.randperm(self.dataset_size, generator=g).tolist())
        return self._order[1]

    def rest(self, progress: Progress, world_size: int, rank: int, generation: int) -> list[Micro]:
        return plan(
            self.order(progress.epoch),
            progress.position,
            world_size,
            rank,
            self.batch_size,
            self.accumulate,
            generation,
            self.layout,
        )

    def steps_done(self, progress: Progress, world_size: int) -> int:
        """Steps of the epoch trained so far, counted at ``world_size``."""
        return -(-progress.position // (self.batch_size * self.accumulate * world_size))


class Epoch(Protocol):
    """The loop's epoch, as the batch iterators ask for it: the rest of it planned, and its
    micro-batches one at a time, with a boundary after each (the façade's)."""

    def planned(self) -> list[Micro]: ...

    def iterate(self, on_plan: Callable[[list[Micro]], None] | None = None) -> Iterator[Micro]: ...


class Batches:
    """``job.batches()``: this rank's sample indices of each micro-batch left in the epoch.

    Iterate it directly, or hand it to a DataLoader as ``batch_sampler`` without worker
    processes; each iteration is the rest of the current epoch. Train each batch inside
    ``with job.step():`` before asking for the next."""

    def __init__(self, epoch: Epoch):
        self._epoch = epoch

    def __len__(self) -> int:
        return len(self._epoch.planned())

    def __iter__(self) -> Iterator[list[int]]:
        for micro in self._epoch.iterate():
            yield micro.indices


class _Segment:
    """The batch sampler of ``Loader``'s DataLoader: the micro-batches of the plan it runs now."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[list[int]]:
        return iter(list(self.batches))


class Loader:
    """``job.loader(dataset, **kwargs)``: a DataLoader over ``dataset`` (``kwargs`` are the
    DataLoader's own: ``num_workers``, ``collate_fn``, ``pin_memory``, ...) that yields this
    rank's batches of the rest of the epoch. Its workers may read ahead: when the group
    changes, what they prefetched for the old plan is dropped and the rest of the epoch is
    loaded as the new group shards it."""

    def __init__(self, epoch: Epoch, dataset: Any, kwargs: dict[str, Any]):
        if isinstance(dataset, IterableDataset):
            raise UsageError(
                f"job.loader() was given an IterableDataset ({type(dataset).__name__}): the job "
                "decides which samples each rank trains by their index, so that it can re-shard "
                "the rest of an epoch when the group changes and prove every sample was trained "
                "once; a stream has no index to resume from. Give a map-style Dataset "
                "(__getitem__ and __len__: an index over your shards or files), and "
                "Elastic(dataset_size=len(dataset))"
            )
        taken = [k for k in _PLANNED if k in kwargs]
        if taken:
            raise UsageError(
                f"job.loader() was given {', '.join(taken)}: the job decides each batch's samples "
                "(Elastic's batch_size, the epoch's order re-sharded over the group): drop "
                f"{'it' if len(taken) == 1 else 'them'}"
            )
        self._epoch = epoch
        self._segment = _Segment()
        self._loader = DataLoader(dataset, batch_sampler=self._segment, **kwargs)
        # A new plan since the DataLoader's iterator was made (see __iter__).
        self._fresh = True

    def __len__(self) -> int:
        return len(self._epoch.planned())

    def __iter__(self) -> Iterator[Any]:
        loaded: Iterator[Any] | None = None
        for _micro in self._epoch.iterate(on_plan=self._start):
            if self._fresh:
                # A plan cut short (the group changed) is dropped with its iterator: its
                # workers stop, or, persistent, start over on the new plan.
                loaded, self._fresh = iter(self._loader), False
            assert loaded is not None
            yield next(loaded)

    def _start(self, planned: list[Micro]) -> None:
        self._segment.batches = [m.indices for m in planned]
        self._fresh = True
