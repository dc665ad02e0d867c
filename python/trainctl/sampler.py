"""Where each rank stands in an epoch: torch's ``DistributedSampler`` layout (pad the rest of
the epoch to a multiple of the world size by repeating its start; rank ``r`` takes every
world-size-th sample from ``r``) from a position inside the epoch that every rank agrees on,
so that a group of any size goes on where the last one stopped. The same arithmetic as the
built-in trainer's (``crates/trainer/src/sampler.rs``); the order itself is the caller's
(``DistributedSampler``'s ``torch.randperm`` seeded by seed + epoch, in ``trainctl.torch``).

Invariant: after ``k`` steps of ``b`` samples per rank on a world of ``w``, exactly the first
``min(k*b*w, rest)`` samples of the epoch's remaining order have been consumed, whatever ``w``
is: a re-sharded epoch loses and repeats nothing.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

MASK = (1 << 64) - 1

_np: Any
try:  # numpy comes with torch's wheels; the package itself needs none
    import numpy as _np
except ImportError:  # pragma: no cover - a Python without numpy digests in pure Python
    _np = None


def _mix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK
    z = x
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK
    return z ^ (z >> 31)


def digest(ids: Iterable[int]) -> int:
    """Samples as one number, whatever their order: the wrapping sum of splitmix64 of each
    id, as the built-in trainer's ``sampler::digest``. Digests add: the ranks' and steps'
    digests sum (mod 2**64) to the epoch's, which is that of all its samples exactly when each
    was trained once."""
    ids = list(ids)
    if _np is not None and len(ids) >= 16:
        return _digest_numpy(ids)
    total = 0
    for i in ids:
        total = (total + _mix(int(i))) & MASK
    return total


def _digest_numpy(ids: list[int]) -> int:
    """``digest`` on numpy's uint64, which wraps as the mask does: a step's 128 ids in a tenth
    of the time (the per-step path of ``trainctl.torch``)."""
    assert _np is not None
    with _np.errstate(over="ignore"):
        z = _np.array(ids, dtype=_np.uint64) + _np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> _np.uint64(30))) * _np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> _np.uint64(27))) * _np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> _np.uint64(31))
        return int(z.sum(dtype=_np.uint64))


class Shard:
    """Rank ``rank``'s share of the rest of an epoch whose order is ``order``, from global
    position ``consumed`` on."""

    def __init__(self, order: Sequence[int], consumed: int, world_size: int, rank: int, batch_size: int):
        if not (world_size > 0 and 0 <= rank < world_size and batch_size > 0):
            raise ValueError(f"rank {rank} of {world_size}, batch {batch_size}")
        n = len(order)
        self.start = min(consumed, n)
        rest = order[self.start :]
        per_rank = -(-len(rest) // world_size)
        self.indices = [rest[(k * world_size + rank) % len(rest)] for k in range(per_rank)] if rest else []
        self.unpadded = -(-max(len(rest) - rank, 0) // world_size)
        self.batch_size = batch_size
        self.world_size = world_size
        self.epoch_len = n

    @property
    def steps(self) -> int:
        return -(-len(self.indices) // self.batch_size)

    def batch(self, step: int) -> list[int]:
        return self.indices[step * self.batch_size : (step + 1) * self.batch_size]

    def unpadded_batch(self, step: int) -> list[int]:
        """The samples of ``batch(step)`` that are the epoch's own (padding left out)."""
        lo = min(step * self.batch_size, self.unpadded)
        hi = min((step + 1) * self.batch_size, self.unpadded)
        return self.indices[lo:hi]

    def position_after(self, steps_done: int) -> int:
        return min(self.start + steps_done * self.batch_size * self.world_size, self.epoch_len)
