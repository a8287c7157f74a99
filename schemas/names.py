"""Names that travel: a run id names every stream, subject and bucket of its run."""

from __future__ import annotations

import re

RUN_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
"""Letters, digits, '_' and '-': safe in a NATS subject token, a stream name and a file name."""


def check_run_id(run: str) -> str:
    """`run`, or ValueError in one line saying what a run id may hold."""
    if not RUN_ID.match(run):
        raise ValueError(f"run id {run!r} must be 1-64 characters of letters, digits, '_' or '-'")
    return run
