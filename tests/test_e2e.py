"""The whole loop as real processes on a real server: it learns, and it keeps its invariants.

Producer, rollout, reward, buffer and trainer run as subprocesses against one nats-server.
Garbage is injected into every stream mid-run. At the end the streams are audited:
every prompt issued is trained or dropped with a reason, none is left in flight; no sample
is trained twice; no token is staler than the bound; each stage dead-lettered its garbage
and kept going; the run directory holds every file the demo promises.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from nats.js.errors import NotFoundError

from bus.connection import connect
from bus.dead import STAGE
from bus.embedded import EmbeddedNats
from bus.topology import BATCHES, DEAD, PROMPTS, REWARDS, TRAJECTORIES, Topology
from ops.audit import audit
from schemas.config import RunConfig

pytestmark = pytest.mark.slow  # a minute or more of real runs: -m 'not slow' skips it

ROOT = Path(__file__).resolve().parent.parent
ROLES = ("trainer", "buffer", "reward", "rollout")
# At the demo's lr (3e-4) the reward is flat for ~200 steps (producers/tasks.py); at 1e-3
# it climbs from ~step 80, which keeps this test short.
STEPS = 150


def e2e_config(tmp_path: Path) -> Path:
    config = yaml.safe_load((ROOT / "examples" / "digits.yaml").read_text())
    config["run"] = "e2e"
    config["trainer"]["steps"] = STEPS
    config["algorithm"]["lr"] = 1e-3
    path = tmp_path / "e2e.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


async def inject_garbage_once_training(url: str, topology: Topology) -> None:
    """Once the first batches are stored (every stage is up), garbage into every stream."""
    nc = await connect(url, "e2e-garbage")
    js = nc.jetstream()
    deadline = time.monotonic() + 120
    while True:
        with contextlib.suppress(NotFoundError):
            if (await js.stream_info(topology.stream(BATCHES))).state.messages >= 2:
                break
        assert time.monotonic() < deadline, "no batch within 120 s"
        await asyncio.sleep(0.5)
    for channel in (PROMPTS, TRAJECTORIES, REWARDS):
        await js.publish(topology.subject(channel), b"\x93garbage " + channel.name.encode())
    await js.publish(topology.subject(BATCHES, 0), b"not a batch")
    await nc.close()


async def audit_run(url: str, topology: Topology) -> tuple[dict, list[str]]:
    nc = await connect(url, "e2e-audit")
    js = nc.jetstream()
    result = await audit(js, topology, RunConfig().staleness)  # the bound 1, the default
    sub = await js.subscribe(topology.subject(DEAD, ">"), ordered_consumer=True)
    count = (await js.stream_info(topology.stream(DEAD))).state.messages
    stages = sorted([(await sub.next_msg(timeout=5)).headers[STAGE] for _ in range(count)])  # type: ignore[index]  # a dead letter has headers
    await nc.close()
    return result, stages


def assert_run_directory(run: Path, summary: dict) -> None:
    """What the demo promises under its run directory (README, producers/report.py)."""
    assert json.loads((run / "summary.json").read_text()) == summary
    assert set(summary) >= {
        "run",
        "started_at",
        "seconds",
        "steps",
        "samples_trained",
        "reward_start",
        "reward_end",
        "max_staleness",
        "staleness_max_seen",
        "groups_dropped",
        "samples_per_s",
    }
    assert (
        summary["samples_trained"] == STEPS * 16 * 8
        and summary["staleness_max_seen"] <= summary["max_staleness"]
    )
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(STEPS))
    assert all({"reward_mean", "loss", "grad_norm", "staleness_hist"} <= set(m) for m in lines)
    for plot in ("reward.png", "staleness.png", "throughput.png"):
        data = (run / plot).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000, f"{plot}: not a plot"


@pytest.mark.timeout(600)
def test_the_loop_learns_and_keeps_its_invariants(
    own_nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    url, topology = own_nats_server.url, Topology(run="e2e")
    logs = {role: open(tmp_path / f"{role}.log", "wb") for role in ROLES}  # noqa: SIM115
    producer: subprocess.Popen[Any] = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "producers.prompts",
            "--config",
            str(e2e_config(tmp_path)),
            "--nats",
            url,
            "--out",
            str(tmp_path / "run"),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    workers = {
        role: subprocess.Popen(
            [sys.executable, "-m", f"consumers.{role}", "--run", "e2e", "--nats", url],
            cwd=ROOT,
            stdout=logs[role],
            stderr=subprocess.STDOUT,
        )
        for role in ROLES
    }
    out = None
    try:
        asyncio.run(inject_garbage_once_training(url, topology))
        with contextlib.suppress(subprocess.TimeoutExpired):
            out, _ = producer.communicate(timeout=480)
        alive = {role: p.poll() for role, p in workers.items() if role != "trainer"}
        assert alive == {"buffer": None, "reward": None, "rollout": None}, "a worker died"
    finally:
        for proc in [*workers.values(), producer]:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in [*workers.values(), producer]:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    if out is None:  # a prompt lost on the way never gets its replacement: the run stalls
        stalled, _ = asyncio.run(audit_run(url, topology))
        raise AssertionError(
            f"the run did not finish in 480 s; in flight: {stalled['in_flight_ids'][:20]}"
        )
    assert producer.returncode == 0, out
    assert {role: p.returncode for role, p in workers.items()} == dict.fromkeys(ROLES, 0)

    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["steps"] == STEPS
    assert summary["reward_start"] <= 0.3
    rewards = [
        json.loads(line)["reward_mean"]
        for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    first, last = np.array(rewards[:25]), np.array(rewards[-25:])
    # Significantly higher: the gap is over 4 standard errors of the difference of means.
    se = np.sqrt(first.var(ddof=1) / len(first) + last.var(ddof=1) / len(last))
    assert last.mean() - first.mean() > max(4 * se, 0.03), (first.mean(), last.mean(), se)
    assert_run_directory(tmp_path / "run", summary)

    result, dead_stages = asyncio.run(audit_run(url, topology))
    assert (
        result["duplicates"] == 0
        and result["trained_and_dropped"] == 0
        and result["unknown_trained"] == 0
    )
    assert result["staleness_violations"] == 0 and result["max_staleness_seen"] <= 1
    # Nothing lost: the gate issues steps * prompts_per_step + one replacement per drop, and the
    # trainer takes exactly that many groups, so at the end none may be left in flight.
    assert result["in_flight"] == 0, (
        f"issued but neither trained nor dropped: {result['in_flight_ids']}"
    )
    assert (
        result["issued"] == result["trained"] + result["dropped"] == STEPS * 16 + result["dropped"]
    )
    assert result["dropped_without_reason"] == [], (
        f"drop records without a reason: {result['dropped_without_reason'][:10]}"
    )
    assert result["unknown_dropped"] == 0, "drop records for prompts never issued"
    assert result["dropped"] == summary["groups_dropped"], (
        "the producer replaced other drops than the audit found"
    )
    assert result["batched_not_trained"] == 0, (
        "stored in a batch, but in no step the trainer reported"
    )
    assert result["steps"] == STEPS and result["samples_trained"] == STEPS * 16 * 8
    assert dead_stages == ["buffer", "reward", "rollout", "trainer"]
