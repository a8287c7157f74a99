"""Prompt sources: built-in generated tasks, jsonl and parquet files.

A source maps a global cursor k to (epoch, index, record), deterministically, so that a
restarted producer resumes at any k with no gap and no duplicate. A file's rows are
shuffled per epoch with `seed + epoch`.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from producers import tasks
from schemas.config import DataConfig

GENERATED_EPOCH = 10_000


def _read_rows(path: Path) -> list[dict[str, Any]]:
    if path.suffix == ".jsonl":
        rows = []
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{path}:{number}: not JSON: {exc.msg}") from None
    elif path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    else:
        raise ValueError(f"{path}: dataset must be .jsonl or .parquet")
    for number, row in enumerate(rows, 1):
        if not isinstance(row, dict) or ("prompt" not in row and "messages" not in row):
            raise ValueError(f"{path}: row {number} has neither a 'prompt' nor a 'messages' field")
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def _as_record(row: dict[str, Any]) -> dict[str, Any]:
    """A file row -> {prompt | messages, task: every other field}."""
    task = {k: v for k, v in row.items() if k not in ("prompt", "messages")}
    return {"prompt": row.get("prompt"), "messages": row.get("messages"), "task": task}


def epoch_size(cfg: DataConfig) -> int:
    return GENERATED_EPOCH if cfg.dataset is None else len(_read_rows(Path(cfg.dataset)))


def records(cfg: DataConfig, start: int) -> Iterator[tuple[int, int, dict[str, Any]]]:
    """(epoch, index, record) from global cursor `start` on, for `cfg.epochs` epochs."""
    if cfg.dataset is None:
        if cfg.task not in tasks.TASKS:
            raise ValueError(
                f"data.task: unknown built-in task {cfg.task!r}; choose from {sorted(tasks.TASKS)}"
            )
        size, task = GENERATED_EPOCH, cfg.task

        def row_at(epoch: int, index: int) -> dict[str, Any]:
            return tasks.task_record(task, epoch * size + index, seed=cfg.seed)

    else:
        rows = _read_rows(Path(cfg.dataset))
        size = len(rows)
        orders: dict[int, list[int]] = {}

        def row_at(epoch: int, index: int) -> dict[str, Any]:
            if epoch not in orders:
                orders.clear()
                orders[epoch] = random.Random(cfg.seed + epoch).sample(range(size), size)
            return _as_record(rows[orders[epoch][index]])

    for k in range(start, cfg.epochs * size):
        epoch, index = divmod(k, size)
        yield epoch, index, row_at(epoch, index)
