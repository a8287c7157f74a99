"""What every section of `ops.gpu_check` shares: progress lines on one clock, and a record of
figures rewritten atomically after each measurement (a section killed at its budget keeps them)."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

# Children count from the parent's start, so every progress line shares one clock.
STARTED = float(os.environ.setdefault("GPU_CHECK_T0", str(time.time())))


def say(section: str, message: str) -> None:
    print(f"[gpu_check {time.time() - STARTED:6.1f}s] {section}: {message}", flush=True)


def one_line(exc: BaseException) -> str:
    text = " ".join(f"{type(exc).__name__}: {exc}".split()) if str(exc) else type(exc).__name__
    return text[:400]


def finite(value: Any) -> Any:
    """JSON-safe copy: NaN and infinities become None (strict JSON has neither)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


class Record:
    """A section's results, rewritten atomically after each measurement (a kill keeps them)."""

    def __init__(self, path: Path, deadline: float) -> None:
        self.path, self.deadline = path, deadline
        self.data: dict[str, Any] = {}

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def put(self, key: str, value: Any) -> None:
        self.data[key] = value
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(finite(self.data)))
        os.replace(tmp, self.path)
