"""The producer's admission gate, as a process against a real server with no trainer.

With v the newest weight version and d the groups dropped, the prompt stream must hold
exactly min(v + max_staleness + 1, steps) * prompts_per_step + d prompts, and stay there
until v or d moves: a gate that never waits overshoots at once, one that never reopens
falls short. Here the test plays the trainer (weights events) and the buffer (drop records).
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError
from nats.js.kv import KeyValue

from bus.connection import connect
from bus.embedded import EmbeddedNats
from bus.publisher import MSG_ID
from bus.topology import PROMPTS, REFUSED_PROMPT, WEIGHTS, Topology, drop_key
from schemas import WeightVersionEvent, encode

ROOT = Path(__file__).resolve().parent.parent
PER_STEP, STALENESS, STEPS = 3, 1, 8
HOLD = 2.0  # seconds a count must stay put once reached
REFUSAL_HANG = 180.0
"""Seconds the refusing rollout waits for the producer to exit: a hang guard, not a timing."""


def gate_config(tmp_path: Path, run: str) -> Path:
    config = {
        "run": run,
        # A path, so the producer builds no model: nothing here generates or trains.
        "model": {"path": str(tmp_path / "no-model")},
        "data": {"n": 2},
        "algorithm": {"prompts_per_step": PER_STEP, "max_staleness": STALENESS},
        "trainer": {"steps": STEPS, "checkpoint_dir": str(tmp_path / "checkpoints")},
    }
    path = tmp_path / "gate.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


async def prompts(js: JetStreamContext, topology: Topology) -> int:
    return (await js.stream_info(topology.stream(PROMPTS))).state.messages


async def holds_exactly(
    js: JetStreamContext,
    topology: Topology,
    producer: subprocess.Popen[bytes],
    expected: int,
    why: str,
    within: float = 15.0,
) -> None:
    """The prompt count reaches `expected` within `within` s, then stays there for HOLD s."""
    deadline = time.monotonic() + within
    while (count := await prompts(js, topology)) < expected and time.monotonic() < deadline:
        assert producer.poll() is None, f"the producer exited with {producer.returncode}"
        await asyncio.sleep(0.1)
    assert count >= expected, (
        f"{why}: the producer issued {count} prompts in {within:.0f} s, the gate admits {expected}"
    )
    until = time.monotonic() + HOLD
    while time.monotonic() < until:
        count = await prompts(js, topology)
        assert count == expected, (
            f"{why}: {count} prompts issued, the gate admits exactly {expected}"
        )
        await asyncio.sleep(0.1)


async def weights(js: JetStreamContext, topology: Topology, version: int) -> None:
    """What the trainer announces after each step (the producer reads only the version)."""
    event = WeightVersionEvent(
        id=f"{topology.run}/weights/{version}",
        run=topology.run,
        version=version,
        step=version,
        location="unused",
        manifest=(),
        total_bytes=0,
    )
    await js.publish(topology.subject(WEIGHTS), encode(event), headers={MSG_ID: event.id})


async def play_trainer_and_buffer(
    url: str, topology: Topology, producer: subprocess.Popen[bytes]
) -> None:
    nc = await connect(url, "test-gate")
    js = nc.jetstream()
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # the producer declares the run's streams
            try:
                await prompts(js, topology)
                break
            except NotFoundError:
                await asyncio.sleep(0.2)
        # No weights yet: the gate starts at version 0. A minute for a loaded machine's start-up.
        await holds_exactly(
            js, topology, producer, (0 + STALENESS + 1) * PER_STEP, "at v0", within=60
        )
        await weights(js, topology, 2)
        await holds_exactly(js, topology, producer, (2 + STALENESS + 1) * PER_STEP, "at v2")
        kv = await js.key_value(topology.kv_bucket)
        await kv.put(drop_key(f"{topology.run}/0/1"), b"all 2 rewards equal (1)")
        await holds_exactly(
            js, topology, producer, (2 + STALENESS + 1) * PER_STEP + 1, "at v2, one group dropped"
        )
        # Past the last step the gate admits the whole run, plus one replacement per drop.
        await weights(js, topology, STEPS + 5)
        await holds_exactly(
            js, topology, producer, STEPS * PER_STEP + 1, "at the last step, one group dropped"
        )
    finally:
        await nc.close()


@pytest.mark.timeout(240)
def test_the_producer_issues_exactly_what_the_gate_admits(
    nats_server: EmbeddedNats, topology: Topology, tmp_path: Path
) -> None:
    log = open(tmp_path / "producer.log", "wb")  # noqa: SIM115 - closed below, after the process
    producer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "producers.prompts",
            "--config",
            str(gate_config(tmp_path, topology.run)),
            "--nats",
            nats_server.url,
            "--out",
            str(tmp_path / "run"),
        ],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        asyncio.run(play_trainer_and_buffer(nats_server.url, topology, producer))
    finally:
        producer.kill()
        producer.wait()
        log.close()


async def refuse_prompts(
    url: str, topology: Topology, producer: subprocess.Popen[str], most: int
) -> int:
    """Play a rollout that refuses every prompt until the producer exits: each refusal opens
    the gate for a replacement; more than `most` prompts issued fails at once. Returns the
    prompts stored once it has exited (it issues no more): what it issued in all."""
    nc = await connect(url, "test-gate-refusals")
    js = nc.jetstream()
    try:
        # Only guards a hang: the producer stops after about a dozen refusals, however slowly
        # a loaded machine starts it.
        deadline = time.monotonic() + REFUSAL_HANG
        kv: KeyValue | None = None
        refused = 0
        while producer.poll() is None:
            assert time.monotonic() < deadline, (
                f"the producer still runs after {REFUSAL_HANG:.0f} s and {refused} refusals"
            )
            try:  # the producer declares the run: streams first, then the KV bucket
                count = await prompts(js, topology)
                kv = kv or await js.key_value(topology.kv_bucket)
            except NotFoundError:  # BucketNotFoundError is one
                await asyncio.sleep(0.1)
                continue
            assert count <= most, f"{count} prompts issued, {refused} refused, the producer runs on"
            for index in range(refused, count):
                reason = REFUSED_PROMPT.encode() + b"rejected: too long"
                await kv.put(drop_key(f"{topology.run}/0/{index}"), reason)
                refused += 1
            await asyncio.sleep(0.1)
        return await prompts(js, topology)
    finally:
        await nc.close()


@pytest.mark.timeout(240)
def test_a_rollout_that_refuses_every_prompt_stops_the_run_with_its_reason(
    nats_server: EmbeddedNats, topology: Topology, tmp_path: Path
) -> None:
    """Refused prompts are replaced like dropped groups; when the rollout refuses nearly all of
    them the producer must stop, saying why, not issue replacements forever.

    No timing: the test refuses each prompt it sees until the producer exits, then checks the
    outcome, which the stop rule fixes however the refusals interleave with the producer's
    reads of them."""
    producer = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "producers.prompts",
            "--config",
            str(gate_config(tmp_path, topology.run)),
            "--nats",
            nats_server.url,
            "--out",
            str(tmp_path / "run"),
        ],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    # The producer stops at its first chance: the gate admits A = (STALENESS + 1) * PER_STEP at
    # v0 plus one per refusal seen, and a prompt is issued only after a check that did not stop,
    # with r refusals seen then: r < 2 * PER_STEP (= A here), or 2r <= issued <= A + r. So
    # r <= A, and whatever the order the producer reads the refusals in, it issues at most 2A + 1.
    most = 2 * (STALENESS + 1) * PER_STEP + 1
    try:
        issued = asyncio.run(refuse_prompts(nats_server.url, topology, producer, most))
        lines = (producer.stderr.read() if producer.stderr else "").strip().splitlines()
        assert producer.returncode != 0 and lines, (producer.returncode, lines)
        said = re.fullmatch(
            r"producers\.prompts: the rollout refused (\d+) of the (\d+) prompts issued; "
            r"the last: (.*)",
            lines[-1],
        )
        assert said and "too long" in said[3], lines[-3:]
        refused, counted = int(said[1]), int(said[2])
        assert counted == issued, f"the producer counts {counted}, the stream holds {issued}"
        # It stopped by the rule (`refusals_stop_the_run`): two steps' worth, more than half.
        assert refused >= 2 * PER_STEP and 2 * refused > issued, (refused, issued)
        assert issued <= most, f"{issued} prompts issued before the producer stopped"
    finally:
        producer.kill()
        producer.wait()
