"""`python -m ops.chaos --quick`: one run of the job with every kind of process SIGKILLed at named
crash points.

The tool arms six crash points (`QUICK.faults`: buffer.mid_step and trainer.mid_checkpoint
among them), one role's after another in its replacements, and lets the supervisor restart
what dies; every point armed must fire, and the run must still finish with no prompt lost,
no sample trained twice and no token staler than the bound (invariant 1-3 in docs/architecture.md).
Takes 2-3 minutes on 2 busy cores.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from bus.connection import connect
from bus.embedded import EmbeddedNats
from bus.publisher import Publisher
from bus.topology import PROMPTS
from ops.chaos import QUICK, ChaosRun
from tests.helpers import prompt

pytestmark = pytest.mark.slow  # a minute or more of real runs: -m 'not slow' skips it

ROOT = Path(__file__).resolve().parent.parent
DEADLINE = 280.0
"""Seconds for the whole tool: the run's own limit (QUICK.timeout), start-up, stop and audit."""


@pytest.mark.timeout(DEADLINE + 40)
def test_every_crash_point_armed_is_hit_and_nothing_is_lost_or_trained_twice(
    tmp_path: Path,
) -> None:
    # A session of its own: on our deadline the tool and its fleet go down together (its
    # nats-server, in a session of its own, dies with the tool).
    proc = subprocess.Popen(
        [sys.executable, "-m", "ops.chaos", "--quick", "--runs", "1", "--out", str(tmp_path)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=DEADLINE)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(
            f"ops.chaos --quick did not finish within {DEADLINE:.0f} s:\n{stdout}{stderr[-3000:]}"
        ) from None
    report = stdout + stderr[-3000:]
    last = stdout.strip().splitlines()[-1:] or [""]
    assert last[0].startswith("{"), f"ops.chaos printed no figures:\n{report}"
    figures = json.loads(last[0])
    assert set(figures["faults"]) == {p.name for p in QUICK.faults}, report
    assert figures["unfinished"] == 0, f"the run did not finish:\n{report}"
    missed = [name for name, fault in figures["faults"].items() if not fault["hit"]]
    assert not missed, f"crash points armed but never hit: {missed}\n{report}"
    assert (figures["lost"], figures["duplicates"], figures["staleness_violations"]) == (0, 0, 0), (
        report
    )
    assert figures["issued"] == figures["trained"] + figures["dropped"] + figures["held"], report
    # Recovery at the default settings: training resumes within 15 s of a restart (measured on a
    # quiet machine); twice that here, where other tests share the two cores.
    slow = {
        role: r["resume_s"]
        for role, r in figures["roles"].items()
        if (r["resume_s"]["max"] or 0) > 2 * 15
    }
    assert not slow, f"training stood still too long after a restart: {slow}\n{report}"
    assert proc.returncode == 0, report


def test_held_prompts_are_those_a_queue_never_had_acked(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    """`held` (in flight, not lost): never delivered, or delivered and not acked when its worker
    stopped."""

    async def scenario() -> tuple[set[str], list[str]]:
        nc = await connect(nats_server.url, "test-chaos")
        run = ChaosRun(
            nats_server.url, nc, tmp_path, f"held-{uuid.uuid4().hex[:8]}", QUICK, random.Random(0)
        )
        await run.declare()
        ids = []
        for i in range(3):
            event = prompt(run.topology.run, i)
            await Publisher(nc.jetstream(), run.topology).publish(PROMPTS, event)
            ids.append(event.id)
        worker = await nc.jetstream().pull_subscribe_bind(
            PROMPTS.work_queue.durable, stream=run.topology.stream(PROMPTS)
        )
        done, _unacked = await worker.fetch(2, timeout=5)
        await done.ack()
        await worker.unsubscribe()  # stopped holding the second; the third was never delivered
        held = await run.held(set(ids))
        await nc.close()
        return held, ids

    held, ids = asyncio.run(scenario())
    assert held == {ids[1], ids[2]}
