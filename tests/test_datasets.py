"""Prompt sources read from files: .jsonl, .parquet, plain prompts and chat `messages`.

A source maps a global cursor to (epoch, index, record): every row once per epoch, in an
order fixed by `seed + epoch`, and a producer restarted at any cursor goes on with no gap
and no duplicate. What cannot be read is refused with one line naming the file and row.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from producers.datasets import epoch_size, records
from schemas import PromptEvent
from schemas.config import DataConfig

ROWS: list[dict[str, Any]] = [
    {"prompt": f"q{i}=", "answer": str(i), "level": i % 3} for i in range(7)
]
CHATS = [
    {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": f"c{i}="},
        ],
        "answer": str(i),
    }
    for i in range(5)
]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def data(path: Path, epochs: int = 2, seed: int = 3) -> DataConfig:
    return DataConfig(dataset=str(path), epochs=epochs, seed=seed)


@pytest.mark.parametrize("write", [write_jsonl, write_parquet], ids=["jsonl", "parquet"])
def test_every_row_once_per_epoch_in_a_seeded_order(tmp_path: Path, write) -> None:
    cfg = data(write(tmp_path / f"rows{'.jsonl' if write is write_jsonl else '.parquet'}", ROWS))
    assert epoch_size(cfg) == len(ROWS)
    out = list(records(cfg, 0))
    assert [(e, i) for e, i, _ in out] == [(e, i) for e in range(2) for i in range(len(ROWS))]
    for epoch in range(2):
        prompts: list[str] = [r["prompt"] for e, _, r in out if e == epoch]
        assert sorted(prompts) == sorted(row["prompt"] for row in ROWS)  # each row once
    orders = [[r["prompt"] for e, _, r in out if e == epoch] for epoch in range(2)]
    assert orders[0] != orders[1], "each epoch is shuffled with its own seed"
    assert orders[0] != [row["prompt"] for row in ROWS], "rows are shuffled, not read in file order"
    # The other fields are the task the reward function reads; the prompt is not among them.
    by_prompt = {row["prompt"]: row for row in ROWS}
    for _, _, record in out:
        assert record["messages"] is None
        assert record["task"] == {
            "answer": by_prompt[record["prompt"]]["answer"],
            "level": by_prompt[record["prompt"]]["level"],
        }


def test_jsonl_and_parquet_of_the_same_rows_give_the_same_records(tmp_path: Path) -> None:
    from_jsonl = list(records(data(write_jsonl(tmp_path / "a.jsonl", ROWS)), 0))
    from_parquet = list(records(data(write_parquet(tmp_path / "a.parquet", ROWS)), 0))
    assert from_jsonl == from_parquet


@pytest.mark.parametrize("cursor", [0, 1, 6, 7, 8, 13])
def test_a_restart_at_any_cursor_goes_on_with_no_gap_and_no_duplicate(
    tmp_path: Path, cursor: int
) -> None:
    cfg = data(write_jsonl(tmp_path / "rows.jsonl", ROWS))
    whole = list(records(cfg, 0))
    assert list(records(cfg, cursor)) == whole[cursor:]


def test_chat_messages_rows_become_prompt_events(tmp_path: Path) -> None:
    cfg = data(write_parquet(tmp_path / "chats.parquet", CHATS), epochs=1)
    out = list(records(cfg, 0))
    assert len(out) == len(CHATS)
    for epoch, index, record in out:
        assert record["prompt"] is None and record["task"].keys() == {"answer"}
        # What the producer builds from the record (the rollout renders the chat template).
        event = PromptEvent(
            id=f"r/{epoch}/{index}",
            run="r",
            source="test",
            epoch=epoch,
            index=index,
            prompt=record["prompt"],
            messages=record["messages"],
            task=record["task"],
            n=2,
        )
        assert event.messages is not None and event.messages[-1] == {
            "role": "user",
            "content": f"c{record['task']['answer']}=",
        }
        assert event.messages[0]["role"] == "system"


def test_unreadable_files_are_refused_in_one_line_naming_the_place(tmp_path: Path) -> None:
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"prompt": "a"}\n{"prompt": \n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not JSON"):
        list(records(data(bad_json), 0))
    no_prompt = write_jsonl(tmp_path / "noprompt.jsonl", [{"prompt": "a"}, {"question": "b"}])
    with pytest.raises(ValueError, match="row 2 has neither a 'prompt' nor a 'messages' field"):
        list(records(data(no_prompt), 0))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="no rows"):
        epoch_size(data(empty))
    csv = tmp_path / "rows.csv"
    csv.write_text("prompt\na\n")
    with pytest.raises(ValueError, match=r"must be \.jsonl or \.parquet"):
        epoch_size(data(csv))
    with pytest.raises(ValueError) as caught:
        list(records(data(bad_json), 0))
    assert "\n" not in str(caught.value)
