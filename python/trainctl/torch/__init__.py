"""Elastic data-parallel PyTorch under ``trainctl run``: see ``help(Elastic)`` and the
repository's README ("Your own PyTorch program, elastic")."""

from ._check import DivergedError
from ._elastic import Elastic, Step
from ._guards import UsageError

__all__ = ["DivergedError", "Elastic", "Step", "UsageError"]
