"""A rank's metrics file, ``RUN_DIR/metrics/rank-N.jsonl``: the built-in trainer's records
(docs/METRICS.md), so ``trainctl report`` and the tests read a PyTorch program's run as they
read the built-in trainer's. Each record is one ``write`` of a whole line (``O_APPEND``), so a
crash leaves at most a partial last line, which the next writer ends first."""

from __future__ import annotations

import json
import os
import time
from typing import Any, cast

SCHEMA_VERSION = 1


class Metrics:
    def __init__(self, run_dir: str, rank: int):
        self.path = os.path.join(run_dir, "metrics", f"rank-{rank}.jsonl")
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.fd: int | None = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        size = os.fstat(self.fd).st_size
        if size:
            with open(self.path, "rb") as f:
                f.seek(size - 1)
                if f.read(1) != b"\n":
                    os.write(self.fd, b"\n")

    def write(self, kind: str, **fields: Any) -> None:
        record = {"kind": kind, **fields}
        record.setdefault("time", time.time())
        # Open: a closed Metrics is not written to (os.write would raise on None).
        os.write(cast(int, self.fd), (json.dumps(record, separators=(",", ":")) + "\n").encode())

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
