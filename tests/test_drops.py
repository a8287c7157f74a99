"""Drops are typed and told: a reward function that raises is named on the console, in the reward
worker's log, in `ops.status` and in summary.json; drops are broken down by kind; too many
failures stop the run with the reason and the resume command; `algorithm.max_regenerations` lets
a step of equal-reward groups train; a stall held back by drops names the reason or settings.

The decisions are checked pure; each claim also on a real nats-server with the real process
(producer, buffer, reward stage, ops.status) where one is involved.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from nats.js import JetStreamContext

from bus.connection import connect
from bus.embedded import EmbeddedNats
from bus.topology import Topology, drop_key, metrics_key
from consumers.buffer import Group, regenerations_left
from producers.drops import DropTally, FailureWindow, failed_share_stop
from producers.gate import Producer
from producers.launcher import write_report
from producers.samples import SamplesWriter
from producers.stall import diagnose
from producers.stall_view import RunView
from schemas import TrajectoryEvent
from schemas.config import AlgorithmConfig, RunConfig, TrainerConfig, parse_config
from schemas.kv_records import DropKind, DropRecord, StepMetrics
from tests.buffer_feed import (
    SETTLE,
    batches,
    declare,
    drained,
    group,
    publish,
    run_with_js,
    start_buffer,
    stop_buffer,
    tail,
    until,
)
from tests.helpers import trajectory
from tests.test_reward import run_config, run_reward_worker

ROOT = Path(__file__).resolve().parent.parent
KEY_ERROR = "raised KeyError: 'expected'"


def failed(samples: int = 2, reason: str = KEY_ERROR) -> DropRecord:
    return DropRecord(
        kind=DropKind.FAILED,
        reason=f"failed sample x: {reason}",
        failures={reason: samples},
        samples=samples,
        time=time.time(),
    )


def equal(value: float = 0.0, samples: int = 2) -> DropRecord:
    return DropRecord(
        kind=DropKind.EQUAL,
        reason=f"all {samples} rewards equal ({value:g})",
        equal_reward=value,
        samples=samples,
        time=time.time(),
    )


# --- pure ------------------------------------------------------------------------------------


def test_a_group_names_its_drop_by_kind_with_the_shared_reward_and_the_failures() -> None:
    g = Group("p", 3)
    for i, r in enumerate(group("r", 0, (0.0, 0.0, 1.0))):
        fails = {"failed": True, "reason": KEY_ERROR} if i < 2 else {}
        g.samples[i] = (r.model_copy(update=fails), None)  # type: ignore[assignment]
    record = g.drop_record()
    assert record is not None and record.kind is DropKind.FAILED
    assert record.failures == {KEY_ERROR: 2} and record.samples == 3
    same = Group("q", 2)
    for i, r in enumerate(group("r", 1, (0.5, 0.5))):
        same.samples[i] = (r, None)  # type: ignore[assignment]
    record = same.drop_record()
    assert record is not None and (record.kind, record.equal_reward) == (DropKind.EQUAL, 0.5)
    assert DropRecord.decode(record.encode()) == record
    # A record stored before kinds: a refusal still reads as one, the rest as unknown.
    assert DropRecord.decode(b"rollout: too long").typed is DropKind.REFUSED
    assert DropRecord.decode(b"all 2 rewards equal (1)").typed is DropKind.UNKNOWN


def test_drops_are_broken_down_by_kind() -> None:
    tally = DropTally()
    assert tally.breakdown() == "0"
    for record in [equal(0.0)] * 180 + [equal(1.0)] * 2 + [failed()] * 4:
        tally.add(record)
    tally.add(DropRecord(kind=DropKind.STALE, reason="stale: version 0 < 1 at step 2"))
    assert tally.breakdown() == "187 (equal 0: 180, equal 1: 2, failed 4, stale 1)"
    assert tally.as_json() == {
        "by_kind": {"equal_rewards": 182, "failed": 4, "stale": 1},
        "equal_by_reward": {"0": 180, "1": 2},
        "reward_failures": {KEY_ERROR: 8},
    }


def test_the_failed_share_stops_past_the_share_of_the_window() -> None:
    window, reasons = FailureWindow(4), Counter({KEY_ERROR: 9, "timed out after 5s": 1})
    window.add(2, 2)
    assert failed_share_stop(window, 0.5, reasons) is None, "2 of 8 if the rest pass"
    window.add(2, 2)
    assert failed_share_stop(window, 0.5, reasons) is None, "4 of 8 is not more than 0.5"
    window.add(2, 2)
    assert failed_share_stop(window, 0.5, reasons) == (
        "the reward function failed 6 of the 6 samples of the first 3 groups, more than 0.5 of "
        f"the 4-group window whatever the rest do (reward.max_failed_share 0.5): {KEY_ERROR}"
    ), "6 of 8 even if the 4th passes: certain before the window is full"
    assert failed_share_stop(window, 0.75, reasons) is None, "6 of 8 is not more than 0.75"
    window.add(0, 2)
    assert failed_share_stop(window, 0.75, reasons) is None, "6 of 8 is not more than 0.75"
    why = failed_share_stop(window, 0.5, reasons)
    assert why == (
        "the reward function failed 6 of the 8 samples of the last 4 groups "
        f"(reward.max_failed_share 0.5): {KEY_ERROR}"
    )
    for _ in range(3):
        window.add(0, 2)  # the failures slide out of the window
    assert failed_share_stop(window, 0.5, reasons) is None


def test_max_regenerations_bounds_the_equal_drops_of_a_step() -> None:
    assert AlgorithmConfig().max_regenerations == 10
    assert regenerations_left(None, 8, 10_000)
    assert regenerations_left(2, 8, 15) and not regenerations_left(2, 8, 16)
    assert not regenerations_left(2, 8, -1), "past the cap until the step forms"
    assert not regenerations_left(0, 8, 0), "0: no equal group is dropped"


def view_with(cfg: RunConfig, drops: DropTally) -> RunView:
    return RunView(cfg, Counter(ROLES), {}, 1, {0: None}, 4, 1, drops.total, drops)


ROLES = ["producer", "rollout", "reward", "buffer", "trainer"]


def test_the_stall_names_the_drops_that_hold_a_step_back() -> None:
    cfg = parse_config({"algorithm": {"prompts_per_step": 2}})
    drops = DropTally()
    for record in [equal(0.0)] * 5 + [failed(3)]:
        drops.add(record)
    lines = diagnose(view_with(cfg, drops))
    assert (
        "the buffer dropped 5 groups since step 0 whose rewards were all equal "
        "(algorithm.drop_equal_reward_groups true, algorithm.max_regenerations 10: after 20 it "
        "trains them)"
    ) in lines, lines
    assert (
        "the reward function failed 3 samples since step 0, so the buffer dropped 1 group: "
        f"3 {KEY_ERROR}"
    ) in lines, lines
    drops.stepped()  # a step came: nothing holds the next one back yet
    assert not any("dropped" in line for line in diagnose(view_with(cfg, drops)))


def test_the_summary_counts_drops_by_kind_and_failures_by_reason(tmp_path: Path) -> None:
    cfg = RunConfig(run="sum")
    producer = Producer(SimpleNamespace(config=cfg))  # type: ignore[arg-type]
    for i, record in enumerate([failed(2), failed(1), equal(0.0)]):
        producer.dropped.add(drop_key(f"sum/0/{i}"))
        producer.count_drop(drop_key(f"sum/0/{i}"), record)
    producer.metrics[0] = StepMetrics(
        step=0,
        time=time.time(),
        train_seconds=1.0,
        samples=8,
        reward_mean=0.5,
        staleness_max=0,
        staleness_hist=[8],
        sample_ids=[],
    ).flat()
    summary = write_report(cfg, producer, SamplesWriter(producer, tmp_path), tmp_path, time.time())
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert summary["groups_dropped"] == 3
    assert summary["drops"] == {
        "by_kind": {"failed": 2, "equal_rewards": 1},
        "equal_by_reward": {"0": 1},
        "reward_failures": {KEY_ERROR: 3},
    }


# --- processes on a real server --------------------------------------------------------------


def test_the_reward_worker_logs_each_failure_reason_once(
    nats_server: EmbeddedNats, topology: Topology, caplog: pytest.LogCaptureFixture
) -> None:
    inputs: list[TrajectoryEvent | bytes] = [trajectory(topology.run, prompt=i) for i in range(4)]
    with caplog.at_level(logging.WARNING, logger="jetrl.reward"):
        rewards, _, _ = run_reward_worker(
            nats_server, topology, run_config(topology, "tests.reward_fns:key_error"), inputs
        )
    assert [r.reason for r in rewards.values()] == [KEY_ERROR] * 4
    logged = [r.getMessage() for r in caplog.records if KEY_ERROR in r.getMessage()]
    assert len(logged) == 1, f"the reason logged {len(logged)} times for 4 failures: {logged}"
    assert "reward function tests.reward_fns:key_error failed on sample" in logged[0]


def test_max_regenerations_lets_a_step_of_equal_groups_train(
    nats_server: EmbeddedNats, topology: Topology, tmp_path: Path
) -> None:
    """Four all-equal groups, 2 prompts a step, max_regenerations 1: two are dropped (typed, with
    the reward they share), the other two form step 0 instead of being dropped for ever."""
    fed = [group(topology.run, i, (1.0, 1.0)) for i in range(4)]
    log = tmp_path / "buffer.log"
    cfg = RunConfig(
        run=topology.run,
        algorithm=AlgorithmConfig(prompts_per_step=2, max_regenerations=1),
        trainer=TrainerConfig(micro_batch_tokens=64),
    )

    async def body(js: JetStreamContext) -> None:
        await declare(js, topology, cfg)
        await publish(js, topology, [r for g in fed for r in g])
        proc = start_buffer(nats_server.url, topology, log)

        async def state() -> str:
            return f"the buffer did not settle 4 groups:\n{tail(log)}"

        try:
            await until(lambda: drained(js, topology), SETTLE, state)
        finally:
            stop_buffer(proc)
        kv = await js.key_value(topology.kv_bucket)
        drops = []
        for g in fed:
            try:
                drops.append(
                    DropRecord.decode((await kv.get(drop_key(g[0].trajectory.prompt_id))).value)
                )
            except Exception:  # noqa: BLE001 - not dropped
                pass
        stored = await batches(js, topology)
        assert len(drops) == 2, f"{len(drops)} groups dropped, not 2: {drops}\n{tail(log)}"
        assert {(d.kind, d.equal_reward) for d in drops} == {(DropKind.EQUAL, 1.0)}
        assert {b.step for b in stored} == {0}, f"steps stored: {[b.step for b in stored]}"
        assert len(stored[0].step_prompt_ids) == 2

    run_with_js(nats_server.url, body)


def job_config(run: str, tmp_path: Path) -> Path:
    raw: dict[str, Any] = {
        "run": run,
        "data": {"n": 2, "reward": "tests.reward_fns:key_error"},
        "algorithm": {"prompts_per_step": 2, "max_staleness": 1},
        "reward": {"max_failed_share": 0.5, "failed_window_groups": 2},
        "trainer": {"steps": 5, "checkpoint_dir": str(tmp_path / "checkpoints")},
        "model": {"path": str(tmp_path / "no-model")},
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(parse_config(raw).model_dump(mode="json")))
    return path


async def put_drops(url: str, topology: Topology, records: dict[int, DropRecord]) -> None:
    nc = await connect(url, "test")
    try:
        kv = await nc.jetstream().key_value(topology.kv_bucket)
        for index, record in records.items():
            await kv.create(drop_key(f"{topology.run}/0/{index}"), record.encode())
    finally:
        await nc.close()


@pytest.mark.timeout(180)
def test_the_main_job_names_a_failing_reward_once_and_stops_past_the_share(
    nats_server: EmbeddedNats, topology: Topology, tmp_path: Path
) -> None:
    """The main job alone (`--nats`): drop records as the buffer writes them. One failed and one
    equal group: the progress line breaks them down, the reason is said once, no stop (2 of 4
    samples is not more than 0.5). Two more failed: the window's 4 of 4 stops the run in one
    line naming the reason and the resume command."""
    out = tmp_path / "out"
    job = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "producers.prompts",
            "--config",
            str(job_config(topology.run, tmp_path)),
        ]
        + ["--nats", nats_server.url, "--out", str(out)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert job.stdout is not None
        first = job.stdout.readline()
        assert first.startswith("run "), first
        line = job.stdout.readline()  # the first progress line: the producer watches the KV
        # No worker joins this run (--nats, no fleet): the line stays the start-up line, and
        # drops show on it once there are any.
        assert "starting workers (0 of 4 ready" in line and "dropped" not in line, line
        asyncio.run(put_drops(nats_server.url, topology, {100: failed(), 101: equal(0.0)}))
        deadline, lines = time.monotonic() + 30, []
        while time.monotonic() < deadline:
            lines.append(job.stdout.readline())
            if "dropped 2 (equal 0: 1, failed 1)" in lines[-1]:
                break
        else:
            pytest.fail(f"no progress line with the drops by kind:\n{''.join(lines[-3:])}")
        asyncio.run(put_drops(nats_server.url, topology, {102: failed(), 103: failed()}))
        try:
            _, stderr = job.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("the run went on although every sample of the last 2 groups failed")
    finally:
        if job.poll() is None:
            job.kill()
            job.communicate()
    assert job.returncode != 0 and "Traceback" not in stderr, stderr[-3000:]
    said = [line for line in stderr.splitlines() if f"failed: {KEY_ERROR} (first" in line]
    assert len(said) == 1, f"the reason said {len(said)} times for 3 failed groups:\n{stderr}"
    last = stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        r"producers\.prompts: stopped: the reward function failed 4 of the 4 samples of the "
        r"last 2 groups \(reward\.max_failed_share 0\.5\): raised KeyError: 'expected'; every "
        r"worker stopped\. Fix the reward function \(tests\.reward_fns:key_error\), then resume "
        rf"with: python -m producers\.prompts --config \S+ --nats \S+ --out {re.escape(str(out))}",
        last,
    ), last


def test_status_shows_drops_by_kind_failures_and_the_stall_they_cause(
    nats_server: EmbeddedNats, topology: Topology
) -> None:
    cfg = parse_config(
        {
            "run": topology.run,
            "data": {"n": 2},
            "algorithm": {"prompts_per_step": 2},
            "trainer": {"steps": 5, "stall_after": 1.0},
        }
    )

    async def setup() -> None:
        nc = await connect(nats_server.url, "test")
        js = nc.jetstream()
        try:
            await declare(js, topology, cfg)
            kv = await js.key_value(topology.kv_bucket)
            step = StepMetrics(
                step=0,
                time=time.time() - 5,
                train_seconds=0.1,
                samples=4,
                reward_mean=0.0,
                staleness_max=0,
                staleness_hist=[],
                sample_ids=[],
            )
            await kv.put(metrics_key(0, 0), step.encode())
            old = failed(1, "timed out after 5s").model_copy(update={"time": time.time() - 60})
        finally:
            await nc.close()
        await put_drops(
            nats_server.url, topology, {0: old, 1: failed(2), 2: equal(0.0), 3: equal(0.0)}
        )

    asyncio.run(setup())
    done = subprocess.run(
        [sys.executable, "-m", "ops.status", "--run", topology.run, "--nats", nats_server.url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    page = done.stdout.splitlines()
    assert "dropped groups: 4 (equal 0: 2, failed 2)" in page, done.stdout
    assert f"reward failures: 2 {KEY_ERROR}, 1 timed out after 5s" in page, done.stdout
    stalled = next((line for line in page if line.startswith("STALLED")), "")
    reasons = stalled.split(": ", 1)[-1].split("; ")  # the stall text's separator
    # Only the drops since step 0 (the time-out came before it) hold step 1 back.
    assert (
        "the reward function failed 2 samples since step 0, so the buffer dropped 1 group: "
        f"2 {KEY_ERROR}"
    ) in reasons, stalled
    assert (
        "the buffer dropped 2 groups since step 0 whose rewards were all equal "
        "(algorithm.drop_equal_reward_groups true, algorithm.max_regenerations 10: after 20 it "
        "trains them)"
    ) in reasons, stalled
