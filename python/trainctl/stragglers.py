"""Finding a slow node across the ranks, as the built-in trainer does (``trainer::train::
stragglers`` in Rust, which this follows line for line): every step each rank's time before the
all-reduce (waiting for its batch, computing) rides the step's gradient all-reduce in slots of
its own, so every rank holds every rank's times and reaches the same verdict at the same step.

A node whose slowest rank takes, on average over the last ``window`` steps (its slowest quarter
of steps left out), more than ``factor`` times the other nodes' median, and at least 5 ms more, at
``window`` steps in a row, is a straggler; it stops being one after ``window`` steps in a row
below the factor, or when the group changes. A group's first ``window`` steps are its warm-up,
no evidence.
"""

from __future__ import annotations

import statistics
from typing import Literal, Optional, Sequence, Tuple, TypedDict, Union

# Slots each rank fills: data, compute, its node.
SLOTS = 3
MIN_EXCESS_S = 0.005

# One rank's times at a step: (its node, data_s, compute_s).
Times = Tuple[int, float, float]


class Straggler(TypedDict):
    """A straggler as ``Watch.step`` names it (``("started", straggler)``): its node and ranks,
    how much slower it is than the other nodes' median, and why."""

    node: int
    ranks: list[int]
    slowdown: float
    cause: str
    data_s: float
    compute_s: float
    others_data_s: float
    others_compute_s: float


# What ``Watch.step`` returns when the verdict changes: ``("started", straggler)`` or
# ``("ended", node, slowdown or None)``.
Change = Union[Tuple[Literal["started"], Straggler], Tuple[Literal["ended"], int, Optional[float]]]


def slots(rank: int, world_size: int, data_s: float, compute_s: float, node: int) -> list[float]:
    """This rank's contribution: zeros but for its own slots (summed, they are everyone's)."""
    v = [0.0] * (SLOTS * world_size)
    v[SLOTS * rank : SLOTS * rank + SLOTS] = [float(data_s), float(compute_s), float(node)]
    return v


def unpack(summed: Sequence[float], world_size: int) -> list[Times]:
    """Every rank's ``(node, data_s, compute_s)`` from the summed slots."""
    out = []
    for r in range(world_size):
        data, compute, node = summed[SLOTS * r : SLOTS * r + SLOTS]
        out.append((int(round(node)), max(data, 0.0), max(compute, 0.0)))
    return out


def relative_speeds(times: Sequence[Times]) -> list[float]:
    """Each rank's time before the all-reduce over the median rank's."""
    busy = [d + c for _, d, c in times]
    m = max(statistics.median(busy), 1e-9) if busy else 1.0
    return [b / m for b in busy]


class Watch:
    def __init__(self, factor: float = 1.5, window: int = 5):
        self.factor = factor
        self.window = max(int(window), 1)
        self.steps: list[Sequence[Times]] = []
        self.current: Straggler | None = None
        self.below = 0
        self.warmup = 0
        # The node slowest at the last steps, and at how many in a row.
        self.candidate: tuple[int, int] | None = None
        self.group_size: int | None = None

    def step(self, times: Sequence[Times]) -> Change | None:
        """Takes one step's times; returns ``("started", straggler)``, ``("ended", node,
        slowdown or None)`` or None."""
        if self.group_size != len(times):
            # Another group (the first, or a node left or joined): its first steps are its warm-up.
            self.group_size = len(times)
            self.steps = []
            self.candidate = None
            self.warmup = self.window
            if self.current is not None:
                gone, self.current = self.current, None
                return ("ended", gone["node"], None)
        if self.warmup > 0:
            self.warmup -= 1
            return None
        self.steps.append(times)
        del self.steps[: -self.window]
        if len(self.steps) < self.window:
            return None
        if self.current is None:
            found = self._slowest()
            if found is None:
                self.candidate = None
                return None
            seen = self.candidate[1] + 1 if self.candidate and self.candidate[0] == found["node"] else 1
            self.candidate = (found["node"], seen)
            if seen < self.window:
                return None
            self.candidate = None
            self.current, self.below = found, 0
            return ("started", found)
        node = self.current["node"]
        slowdown = self._node_slowdown(node)
        if slowdown is not None and slowdown >= self.factor:
            self.below = 0
            return None
        self.below += 1
        if self.below < self.window:
            return None
        self.current = None
        return ("ended", node, slowdown)

    def _node_figures(self) -> list[tuple[int, list[int], float, float]]:
        """Each node's ranks and its mean data and compute time per step over the window, its
        slowest quarter of steps (at least one) left out (a node's time at a step is its
        slowest rank's)."""
        last = self.steps[-1]
        out = []
        for node in sorted({n for n, _, _ in last}):
            ranks = [r for r, (n, _, _) in enumerate(last) if n == node]
            per_step: list[Times] = []
            for step in self.steps:
                mine = [t for t in step if t[0] == node]
                if mine:
                    per_step.append(max(mine, key=lambda t: t[1] + t[2]))
            if len(per_step) >= 3:
                per_step.sort(key=lambda t: t[1] + t[2])
                del per_step[len(per_step) - max(len(per_step) // 4, 1) :]
            n = max(len(per_step), 1)
            out.append(
                (node, ranks, sum(t[1] for t in per_step) / n, sum(t[2] for t in per_step) / n)
            )
        return out

    def _slowest(self) -> Straggler | None:
        figures = self._node_figures()
        if len(figures) < 2:
            return None
        best: Straggler | None = None
        for node, ranks, data, compute in figures:
            others = [m for m in figures if m[0] != node]
            od = statistics.median([m[2] for m in others])
            oc = statistics.median([m[3] for m in others])
            busy, others_busy = data + compute, od + oc
            if busy < others_busy * self.factor or busy - others_busy < MIN_EXCESS_S:
                continue
            slowdown = busy / max(others_busy, 1e-9)
            if best is not None and best["slowdown"] >= slowdown:
                continue
            best = {
                "node": node,
                "ranks": ranks,
                "slowdown": slowdown,
                "cause": "data loading" if data - od > compute - oc else "compute",
                "data_s": data,
                "compute_s": compute,
                "others_data_s": od,
                "others_compute_s": oc,
            }
        return best

    def _node_slowdown(self, node: int) -> float | None:
        figures = self._node_figures()
        mine = [m for m in figures if m[0] == node]
        others = [m[2] + m[3] for m in figures if m[0] != node]
        if not mine or not others:
            return None
        return (mine[0][2] + mine[0][3]) / max(statistics.median(others), 1e-9)


def ranks_text(ranks: Sequence[int]) -> str:
    if not ranks:
        return "none"
    if len(ranks) == 1:
        return str(ranks[0])
    if ranks[-1] - ranks[0] + 1 == len(ranks):
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(str(r) for r in ranks)


def started_text(s: Straggler, window: int) -> str:
    return (
        f"node {s['node']} (ranks {ranks_text(s['ranks'])}) is a straggler: "
        f"{s['slowdown']:.1f}× the other nodes' time per step over the last {window} steps, "
        f"from {s['cause']} ({s['compute_s']:.3f} s of compute and {s['data_s']:.3f} s waiting "
        f"for data a step, against {s['others_compute_s']:.3f} s and {s['others_data_s']:.3f} s)"
    )


def ended_text(node: int, slowdown: float | None) -> str:
    if slowdown is None:
        return f"node {node} is no longer a straggler: the group changed (it may have left)"
    return f"node {node} is no longer a straggler ({slowdown:.1f}× the other nodes' time per step)"
