"""`python -m ops.chaos --quick`: one run of the job with every kind of process SIGKILLed once.

The tool kills the producer, rollout, reward, buffer and trainer (mid-step and
mid-checkpoint) and lets the supervisor restart them; the run must still finish with no
prompt lost, no sample trained twice and no token staler than the bound (DESIGN invariants
1-3). Takes 1-2 minutes on 2 cores.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from bus.connection import connect
from bus.embedded import EmbeddedNats
from bus.publisher import Publisher
from ops.chaos import FAULTS, QUICK, ChaosRun
from tests.helpers import prompt

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(300)
def test_every_kind_of_kill_loses_nothing_and_trains_nothing_twice(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "ops.chaos", "--quick", "--runs", "1", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=280,
    )
    report = proc.stdout + proc.stderr[-3000:]
    figures = json.loads(proc.stdout.strip().splitlines()[-1])
    assert figures["unfinished"] == 0, report
    assert figures["kills"] == len(FAULTS), report
    assert (figures["lost"], figures["duplicates"], figures["staleness_violations"]) == (0, 0, 0), report
    assert figures["issued"] == figures["trained"] + figures["dropped"] + figures["held"], report
    assert proc.returncode == 0, report


def test_held_prompts_are_those_a_queue_never_had_acked(nats_server: EmbeddedNats, tmp_path: Path) -> None:
    """`held` (in flight, not lost): never delivered, or delivered and not acked when its worker stopped."""

    async def scenario() -> tuple[set[str], list[str]]:
        nc = await connect(nats_server.url, "test-chaos")
        run = ChaosRun(nats_server.url, nc, tmp_path, f"held-{uuid.uuid4().hex[:8]}", QUICK, random.Random(0))
        await run.declare()
        ids = []
        for i in range(3):
            event = prompt(run.topology.run, i)
            await Publisher(nc.jetstream()).publish(run.topology.subject("prompts"), event)
            ids.append(event.id)
        worker = await nc.jetstream().pull_subscribe_bind("rollout", stream=run.topology.stream("prompts"))
        done, _unacked = await worker.fetch(2, timeout=5)
        await done.ack()
        await worker.unsubscribe()  # stopped holding the second; the third was never delivered
        held = await run.held(set(ids))
        await nc.close()
        return held, ids

    held, ids = asyncio.run(scenario())
    assert held == {ids[1], ids[2]}
