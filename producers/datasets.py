"""Prompt sources: built-in generated tasks (`producers.tasks`; `producers.agent_tasks`, whose
prompts are chat messages for agent episodes), jsonl and parquet files.

A source maps a global cursor k to (epoch, index, record), deterministically, so that a
restarted producer resumes at any k with no gap and no duplicate. A file's rows are
shuffled per epoch with `seed + epoch`.
"""

from __future__ import annotations

import itertools
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from producers import agent_tasks, tasks
from schemas.config import DataConfig
from schemas.model_config import WarmStartConfig

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
        if cfg.task in agent_tasks.TASKS:  # chat messages for agent episodes
            make = agent_tasks.task_record
        elif cfg.task in tasks.TASKS:
            make = tasks.task_record
        else:
            known = sorted([*tasks.TASKS, *agent_tasks.TASKS])
            raise ValueError(f"data.task: unknown built-in task {cfg.task!r}; choose from {known}")
        size, task = GENERATED_EPOCH, cfg.task

        def row_at(epoch: int, index: int) -> dict[str, Any]:
            return make(task, epoch * size + index, seed=cfg.seed)

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


def demonstrations(warm: WarmStartConfig, data: DataConfig) -> Iterator[list[dict[str, Any]]]:
    """The warm start's conversations, endlessly (`model.warm_start`): the file's rows'
    `messages`, reshuffled each pass; or the built-in agent task's generated ones."""
    if warm.dataset is None:
        return (agent_tasks.demonstration(i, seed=data.seed) for i in itertools.count())
    path = Path(warm.dataset)
    rows = _read_rows(path)
    for number, row in enumerate(rows, 1):
        messages = row.get("messages")
        if not isinstance(messages, list) or not any(
            isinstance(m, dict) and m.get("role") == "assistant" for m in messages
        ):
            raise ValueError(f"{path}: row {number} has no `messages` with an assistant turn")

    def passes() -> Iterator[list[dict[str, Any]]]:
        for epoch in itertools.count():
            for i in random.Random(data.seed + epoch).sample(range(len(rows)), len(rows)):
                yield rows[i]["messages"]

    return passes()
