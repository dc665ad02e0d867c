"""Copies of the model the loop keeps without giving them to ``Elastic``: an ``AveragedModel``,
an EMA module or a dict of shadow tensors, a "best weights" dict. Such a copy does not travel
to a joining rank, is not in the checkpoint and is not compared among the ranks: a rank that
comes in (rank 0's replacement among them) starts it afresh, and the saved EMA silently misses
the updates before. A copy that never changes (a frozen teacher, a reference model) is every
rank's alike and needs none of that.

So the process's objects are looked through (the garbage collector's list) for copies: a
module, or a dict, holding tensors of every shape the model's parameters have, none of them
the model's own storage. A copy found is fingerprinted; one whose fingerprint later changes is
refused with what to do (``UsageError``). Knows nothing of ``Elastic``: it is given the model
and the objects the job already keeps.
"""

from __future__ import annotations

import gc
import sys
import warnings
import zlib
from collections import Counter
from typing import Any, Iterable

import torch

from ._errors import UsageError


class Copy:
    """A copy of the model found among the process's objects."""

    def __init__(self, obj: Any, tensors: list[torch.Tensor]):
        self.ref = obj
        self.kind = type(obj).__name__
        self.size = len(tensors)
        self.keys = [str(k) for k in list(dict.keys(obj))[:3]] if isinstance(obj, dict) else []
        self.fingerprint = _crc(tensors)

    def describe(self) -> str:
        article = "an" if self.kind[:1].lower() in "aeiou" else "a"
        if self.keys:
            return f"{article} {self.kind} of {self.size} tensors shaped like the model's ({', '.join(self.keys)}, ...)"
        return f"{article} {self.kind} holding a copy of the model's parameters"


class Strays:
    """The copies of one model (see the module's doc)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        self.copies: list[Copy] = []
        self.scans = 0
        # The step of the first look, and whether the copies were checked since.
        self._first_at = 0
        self._checked = False

    def at_boundary(self, step: int, known: Iterable[Any]) -> None:
        """At a boundary of the loop, global step ``step``: the first look after the first
        update, and the copies found refused if they changed two updates later."""
        if not self.scans:
            if step >= 1:
                self.scan(known)
                self._first_at = step
        elif step >= self._first_at + 2 and not self._checked:
            self._checked = True
            self.refuse_changed()

    def at_epoch_end(self, known: Iterable[Any]) -> None:
        """At every epoch's end the copies are checked again, and after the first epoch the
        process looked through once more (a copy made lazily)."""
        self.refuse_changed()
        if self.scans == 1:
            self.scan(known)

    def scan(self, known: Iterable[Any]) -> None:
        """Looks for copies among the process's objects, leaving out the ``known`` ones (given
        to the job, and their parts); the copies already found keep their first fingerprint."""
        self.scans += 1
        shapes = Counter(tuple(p.shape) for p in self.model.parameters())
        if not shapes:
            return
        own = _storages(list(self.model.parameters()) + list(self.model.buffers()))
        skip = {id(m) for m in self.model.modules()}
        # Modules' namespaces: the largest dicts of a process with torch loaded, and no copy.
        skip.update(id(vars(m)) for m in list(sys.modules.values()) if hasattr(m, "__dict__"))
        for obj in known:
            skip.update(_parts(obj))
        seen = {id(c.ref) for c in self.copies}
        found: list[tuple[Any, list[torch.Tensor]]] = []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # One pass in C over the collector's list (a tenth of a second with torch loaded).
            holders = [o for o in gc.get_objects() if isinstance(o, (torch.nn.Module, dict))]
            for obj in holders:
                if id(obj) in skip or id(obj) in seen:
                    continue
                tensors = _tensors_of(obj, len(shapes))
                if tensors is None or not _covers(tensors, shapes) or _storages(tensors) & own:
                    continue
                found.append((obj, tensors))
        # A copy inside another one found (an AveragedModel's own `module`) is the same copy.
        inner: set[int] = set()
        for obj, _ in found:
            if isinstance(obj, torch.nn.Module):
                inner.update(id(m) for m in obj.modules() if m is not obj)
        self.copies += [Copy(obj, tensors) for obj, tensors in found if id(obj) not in inner]

    def refuse_changed(self) -> None:
        """``UsageError`` for the first copy whose tensors changed since it was found."""
        for c in self.copies:
            tensors = _tensors_of(c.ref, 0)
            if tensors is not None and _crc(tensors) != c.fingerprint:
                raise UsageError(_refusal(c))


def _refusal(c: Copy) -> str:
    averaged = callable(getattr(c.ref, "update_parameters", None))
    if isinstance(c.ref, dict):
        fix = (
            "keep it in an object with state_dict() and load_state_dict() (a small class, or an "
            "nn.Module) and give that to Elastic as state=..."
        )
    else:
        fix = "give it to Elastic as state=... (several objects: a list or dict of them)"
    update = (
        "; the job then gates its update_parameters(): after a step that applied no update it does nothing"
        if averaged
        else "; update it after `with job.step() as step:` only `if step.applied:`"
    )
    return (
        f"{c.describe()} changes during training but was not given to Elastic: it would not "
        "travel to a joining rank or into the checkpoint, and a rank that comes in (rank 0's "
        f"replacement too) would start it afresh, so the model you save would be wrong: {fix}{update}"
    )


def _parts(obj: Any) -> set[int]:
    """``obj`` and what it holds directly (a module's submodules, an object's attributes and
    the dicts among them): an object given to the job keeps its tensors there."""
    out = {id(obj)}
    if isinstance(obj, torch.nn.Module):
        out.update(id(m) for m in obj.modules())
    values = list(dict.values(obj)) if isinstance(obj, dict) else list(getattr(obj, "__dict__", {}).values())
    if hasattr(obj, "__dict__"):
        out.add(id(obj.__dict__))
    for v in values:
        if isinstance(v, (dict, list, torch.nn.Module)):
            out.add(id(v))
            if isinstance(v, torch.nn.Module):
                out.update(id(m) for m in v.modules())
    return out


def _tensors_of(obj: Any, at_least: int) -> list[torch.Tensor] | None:
    """A module's parameters and buffers, or a dict's tensor values; None for anything else
    (or fewer than ``at_least`` tensors). A dict is read as stored (``dict.values``), never
    through a subclass's own methods: some compute their values on demand (transformers' lazy
    model mappings import every model)."""
    t = type(obj)
    if issubclass(t, torch.nn.Module):
        return list(obj.parameters()) + list(obj.buffers())
    if issubclass(t, dict) and dict.__len__(obj) >= at_least:
        values = [v for v in dict.values(obj) if isinstance(v, torch.Tensor)]
        return values if len(values) >= at_least and values else None
    return None


def _covers(tensors: list[torch.Tensor], shapes: Counter[tuple[int, ...]]) -> bool:
    """Whether the tensors have every shape of ``shapes``, as many times."""
    have = Counter(tuple(t.shape) for t in tensors)
    return all(have[s] >= n for s, n in shapes.items())


def _storages(tensors: list[torch.Tensor]) -> set[int]:
    out = set()
    for t in tensors:
        try:
            out.add(t.untyped_storage().data_ptr())
        except (RuntimeError, NotImplementedError):
            pass
    return out


def _crc(tensors: list[torch.Tensor]) -> int:
    crc = 0
    for t in tensors:
        crc = zlib.crc32(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes(), crc)
    return crc
