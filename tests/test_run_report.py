"""The run directory's record without a run: rates count only this process's steps, a second
segment appends, the throughput plot's rates skip a resume's downtime, the start-up lines, a
samples line and the wandb samples rows, and `ops.samples`' rendering."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from bus.embedded import free_port
from bus.run_dir import write_server
from consumers.trainer_loggers import sample_rows
from consumers.trainer_start import start_line
from ops.samples import follow, groups, render
from ops.status import parse
from producers import report
from producers.prompts import missing_local_model, unreadable_dataset
from producers.samples import group_line
from producers.startup import all_ready, expected_workers, starting_line
from schemas import BatchEvent, RewardEvent
from schemas.config import DataConfig, RunConfig
from schemas.tensor import Tensor
from tests.helpers import ROOT, trajectory


def step(n: int, time: float, samples: int = 128) -> dict:
    return {
        "step": n,
        "time": time,
        "samples": samples,
        "reward_mean": 0.5,
        "staleness_max": 1,
        "staleness_hist": [100, 28],
        "sample_ids": ["x"],
    }


def test_the_rate_after_a_resume_counts_only_the_steps_trained_since() -> None:
    """A resumed run reads its 100 earlier steps back; 10 s after its start it has trained 2:
    256 samples in 10 s, not 12,800 (the 1,824 samples/s of a resumed run's first line)."""
    old = [step(i, 1000.0 + i) for i in range(100)]
    new = [step(100, 5005.0), step(101, 5008.0)]
    assert report.rate_since(old + new, since=5000.0, now=5010.0) == 256 / 10


def test_a_second_segment_appends_its_steps_and_keeps_the_first(tmp_path: Path) -> None:
    first = [step(i, 100.0 + i) for i in range(3)]
    report.write(tmp_path, first, run="r", started=99.0, now=103.0, max_staleness=1, dropped=0)
    written = (tmp_path / "metrics.jsonl").read_text()
    # The resumed producer reads every step back from KV, steps 0-2 retrained with new times.
    again = [step(i, 500.0 + i) for i in range(5)]
    summary = report.write(
        tmp_path, again, run="r", started=499.0, now=505.0, max_staleness=1, dropped=2
    )
    after = (tmp_path / "metrics.jsonl").read_text()
    assert after.startswith(written)
    assert [json.loads(line)["time"] for line in after.splitlines()] == [
        100.0,
        101.0,
        102.0,
        503.0,
        504.0,
    ]
    assert summary == json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 5 and summary["samples_trained"] == 5 * 128
    assert [s["samples_trained"] for s in summary["segments"]] == [3 * 128, 5 * 128]
    assert summary["seconds"] == 4.0 + 6.0 and summary["samples_per_s"] == 8 * 128 / 10.0
    assert summary["started_at"] == 99.0 and summary["groups_dropped"] == 2
    assert (tmp_path / "throughput.png").exists()


def test_throughput_skips_the_resume_gap_and_smooths() -> None:
    metrics = [step(0, 10.0), step(1, 11.0), step(2, 13.0), step(3, 500.0), step(4, 502.0)]
    pairs = report.step_rates(metrics, starts=[9.0, 400.0])
    assert pairs == [(11.0, 128.0, 1.0), (13.0, 128.0, 2.0), (502.0, 128.0, 2.0)]
    assert report.smoothed(pairs[:2], window=2) == [128.0, 256 / 3]


def test_the_start_up_line_says_which_workers_are_up() -> None:
    cfg = RunConfig()
    expected = expected_workers(cfg)
    assert expected == Counter(trainer=1, buffer=1, reward=1, rollout=1)
    live = Counter(producer=1, buffer=1, reward=2)
    assert starting_line(live, expected) == (
        "starting workers (2 of 4 ready; waiting for trainer, rollout)"
    )
    assert starting_line(Counter(expected), expected) == "starting workers (4 of 4 ready)"
    assert starting_line(None, expected) == "starting workers (? of 4 ready)"
    # Once every worker is up, the step line takes over before step 0 (it shows the drops).
    assert not all_ready(live, expected) and not all_ready(None, expected)
    assert all_ready(Counter(expected) + Counter(rollout=1), expected)


def test_the_trainer_says_when_it_replays_stored_steps() -> None:
    assert start_line(0, 0, False, 41, 1) == (
        "rank 0 replays steps 0-41 from stored batches (no checkpoint yet), from batch sequence 1"
    )
    assert start_line(0, 0, False, None, 1) == (
        "rank 0 starts at step 0, batch sequence 1 (no checkpoint, no stored batches)"
    )
    assert start_line(1, 40, True, 41, 900) == (
        "rank 1 resumes from its checkpoint at step 40, replaying steps 40-41 from stored batches"
    )
    assert start_line(0, 40, True, 39, 900) == (
        "rank 0 resumes from its checkpoint at step 40, batch sequence 900"
    )


def decode(ids: object) -> str:
    return "".join(f"<{i}>" for i in ids)  # type: ignore[attr-defined]


def test_a_samples_line_has_text_rewards_failures_versions_and_staleness() -> None:
    rewards = []
    for i in (1, 0):
        t = trajectory("r", prompt=8, sample=i, tokens=3, group=2)
        t = t.model_copy(update={"versions": Tensor.from_numpy(np.array([4, 3, 4], np.int32))})
        rewards.append(
            RewardEvent(
                id=t.id,
                run="r",
                trajectory=t,
                reward=0.0 if i else 0.75,
                failed=bool(i),
                reason="timed out" if i else "",
            )
        )
    line = group_line(rewards, decode, step=5)
    assert line["prompt_id"] == "r/0/8" and line["prompt"] == "<0><1><2><3><4>"
    assert (line["step"], line["version"], line["staleness"], line["outcome"]) == (
        5,
        3,
        2,
        "trained",
    )
    assert [(r["index"], r["text"], r["reward"], r["failed"]) for r in line["responses"]] == [
        (0, "<0><1><2>", 0.75, None),
        (1, "<0><1><2>", 0.0, "timed out"),
    ]
    assert [(r["version"], r["staleness"]) for r in line["responses"]] == [(3, 2), (3, 2)]
    dropped = group_line(rewards, None, step=None, dropped="failed sample r/0/8/1: timed out")
    assert dropped["outcome"] == "dropped" and dropped["staleness"] is None
    assert dropped["prompt"] is None and dropped["prompt_ids"] == [0, 1, 2, 3, 4]
    assert dropped["responses"][0]["text"] == "1 2 3"  # the rollout's own text, no tokenizer
    shown = render(dropped)
    assert "dropped: failed sample r/0/8/1: timed out" in shown and "FAILED: timed out" in shown


def two_groups_batch() -> BatchEvent:
    """Step 5's micro-batch of samples r/0/8/2 (prompt 7 8 9, response 1 2, a pad) and r/0/3/0
    (prompt 7 8, response 3 4 5 6); every response token of version 3."""
    ids = np.array([[7, 8, 9, 1, 2, 0], [7, 8, 3, 4, 5, 6]], np.int32)
    attention = np.array([[1, 1, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1]], np.uint8)
    loss = np.array([[0, 0, 0, 1, 1, 0], [0, 0, 1, 1, 1, 1]], np.uint8)
    versions = np.where(loss == 1, 3, -1).astype(np.int32)
    return BatchEvent(
        id="r/step/5/0/0",
        run="r",
        step=5,
        dp_rank=0,
        dp_size=1,
        micro_index=0,
        micro_count=1,
        input_ids=Tensor.from_numpy(ids),
        attention_mask=Tensor.from_numpy(attention),
        loss_mask=Tensor.from_numpy(loss),
        advantages=Tensor.from_numpy(np.array([0.5, -0.5], np.float32)),
        behaviour_logprobs=Tensor.from_numpy(np.where(loss == 1, -1.0, 0.0).astype(np.float32)),
        versions=Tensor.from_numpy(versions),
        rewards=Tensor.from_numpy(np.array([1.0, 0.0], np.float32)),
        sample_ids=("r/0/8/2", "r/0/3/0"),
    )


def test_the_wandb_samples_rows_are_the_chosen_groups_decoded() -> None:
    """Rows of groups 8 and 3 of a step; report.samples_every 8 keeps group 8's only, its prompt
    the tokens before the first loss token, its response the real ones from it on."""
    batch = two_groups_batch()
    rows = sample_rows(5, [batch], RunConfig(), decode)
    assert rows == [[5, "r/0/8/2", "<7><8><9>", "<1><2>", 1.0, 0.5, 3, 2]]


def test_status_by_a_run_dir_without_a_server_says_so_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse(["--out", str(tmp_path)])
    assert exited.value.code == 1
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"ops.status: {tmp_path} has no server.json: its local job is not")
    write_server(tmp_path, "demo", "nats://127.0.0.1:4999", tmp_path / "identities" / "admin.nk")
    args = parse(["--out", str(tmp_path)])
    assert (args.run, args.nats, args.identity) == (
        "demo",
        "nats://127.0.0.1:4999",
        tmp_path / "identities" / "admin.nk",
    )


def test_status_with_no_server_is_one_line_naming_the_run_dir_way() -> None:
    """`ops.status --run demo` beside a local job (whose server is on a port of its own) once
    printed twenty connection errors before its answer."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "ops.status",
            "--run",
            "demo",
            "--nats",
            f"nats://127.0.0.1:{free_port()}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1 and done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1, lines
    line = lines[0]
    assert line.startswith("ops.status: cannot reach NATS at nats://127.0.0.1:"), line
    assert line.endswith("(a local job's server: give --out <its run directory>)"), line


def test_ops_samples_filters_a_step_and_follows_appended_lines(tmp_path: Path) -> None:
    path = tmp_path / "samples.jsonl"
    path.write_text(json.dumps({"prompt_id": "r/0/0", "step": 1}) + "\n")
    lines = ['{"prompt_id": "a", "step": 1}', "not json", '{"prompt_id": "b", "step": 2}']
    assert [g["prompt_id"] for g in groups(iter(lines), 2)] == ["b"]
    with open(path) as file:
        tail = follow(file)
        assert json.loads(next(tail))["prompt_id"] == "r/0/0"
        with open(path, "a") as f:  # the job appends a line in two writes
            f.write('{"prompt_id": "r/0/8",')
            f.flush()

            def finish() -> None:
                f.write(' "step": 2}\n')
                f.flush()

            threading.Timer(0.3, finish).start()
            # the partial line is not yielded until its end comes
            assert next(tail) == '{"prompt_id": "r/0/8", "step": 2}\n'


def test_a_local_job_names_a_missing_model_file_before_any_worker_starts(tmp_path: Path) -> None:
    assert missing_local_model("/nope/m.gguf") == "model.path '/nope/m.gguf': no such GGUF file"
    assert missing_local_model("./nope") == "model.path './nope': no such directory"
    assert missing_local_model("HuggingFaceTB/SmolLM2-135M-Instruct") is None  # the workers'
    assert missing_local_model(str(tmp_path)) is None and missing_local_model(None) is None


def test_a_dataset_the_producer_cannot_read_is_one_line_before_any_worker_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    data = DataConfig(dataset="add.jsonl")
    assert unreadable_dataset(data) == f"data.dataset 'add.jsonl': no such file (in {tmp_path})"
    (tmp_path / "add.jsonl").write_text('{"x": 1}\n')
    assert unreadable_dataset(data) == (
        "data.dataset: add.jsonl: row 1 has neither a 'prompt' nor a 'messages' field"
    )
    (tmp_path / "add.jsonl").write_text('{"prompt": "1+1=", "target": "2"}\n')
    assert unreadable_dataset(data) is None and unreadable_dataset(DataConfig()) is None
    out = tmp_path / "run"
    job = subprocess.run(
        [sys.executable, "-m", "producers.prompts", "model.path=./missing.gguf", "--out", str(out)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert (job.returncode, job.stderr) == (
        1,
        "producers.prompts: model.path './missing.gguf': no such GGUF file\n",
    )
    assert not out.exists()  # nothing started, nothing written
