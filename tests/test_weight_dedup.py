"""A trainer resumed from a checkpoint republishes its versions, and rollout workers load them.

The trainer (a real process) publishes v0..v5, one version a step, and is SIGKILLed once step
4's metrics are written, before its checkpoint at step 5: its checkpoint holds 3 steps. Within
the stream's dedup window (an hour) it is restarted; it retrains steps 3 and 4 and publishes v4
and v5 again. On a GPU a retrained step is not bit-for-bit the step that died; here that is
made so by nudging the checkpoint's weights before the restart. A real rollout worker serving
the pre-crash v5 must then serve the restarted trainer's v5 (its final checkpoint), bit for bit:
with the version number alone as `Nats-Msg-Id` the server dropped those events as duplicates,
and the worker kept weights no trainer holds.

A publisher's retry of one event (the same announcement) is still stored once.
Full versions and delta chains (the restart starts a new chain at v4) both.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
from nats.js import JetStreamContext

from bus.crashpoints import CRASH_AT
from bus.embedded import EmbeddedNats
from bus.topology import WEIGHTS, Topology
from producers.launcher import attach_bootstrap
from schemas import WeightVersionEvent, decode
from schemas.config import RunConfig
from tests.test_rollout_invariants import eventually, rollout_worker
from tests.test_trainer_resume import GROUP, PROMPTS_PER_STEP, record

ROOT = Path(__file__).resolve().parent.parent
STEPS, CHECKPOINT_EVERY = 5, 3
"""Killed after step 4 (v5 published), before the run's last checkpoint: it resumes from step 3."""


def run_config(run: str, model: Path, checkpoints: Path, weights: dict) -> RunConfig:
    return RunConfig.model_validate(
        {
            "run": run,
            "model": {"path": str(model)},
            "data": {"n": GROUP},
            "weights": weights,
            "algorithm": {"prompts_per_step": PROMPTS_PER_STEP},
            "trainer": {
                "steps": STEPS,
                "checkpoint_every": CHECKPOINT_EVERY,
                "micro_batch_tokens": 64,
                "checkpoint_dir": str(checkpoints),
            },
        }
    )


def trainer(url: str, run: str, log: Path, crash_at: str = "") -> subprocess.Popen[bytes]:
    env = (
        {**os.environ, CRASH_AT: crash_at}
        if crash_at
        else {k: v for k, v in os.environ.items() if k != CRASH_AT}
    )
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "consumers.trainer", "--run", run, "--nats", url],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )


def served(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def same_bits(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return all(
        torch.equal(a[name].view(torch.int32), b[name].to(a[name].dtype).view(torch.int32))
        for name in a
    )


async def weight_events(js: JetStreamContext, topology: Topology) -> list[WeightVersionEvent]:
    count = (await js.stream_info(topology.stream(WEIGHTS))).state.messages
    sub = await js.subscribe(topology.subject(WEIGHTS), ordered_consumer=True)
    try:
        return [
            decode((await sub.next_msg(timeout=10)).data, WeightVersionEvent) for _ in range(count)
        ]
    finally:
        await sub.unsubscribe()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("delta", [False, True], ids=["full", "delta"])
def test_resumed_trainer_versions_reach_rollout_workers(
    nats_server: EmbeddedNats, model_dir: Path, tmp_path: Path, delta: bool
) -> None:
    weights = {"delta": delta, "full_every": 8}
    config = run_config(f"dedup-{uuid.uuid4().hex[:8]}", model_dir, tmp_path / "ckpt", weights)
    topology = Topology.for_config(config)
    log = tmp_path / "trainer.log"

    async def scenario() -> None:
        async with rollout_worker(nats_server.url, topology, model_dir, weights=weights) as w:
            rt = await attach_bootstrap(
                config, nats_server.url
            )  # the trainer's config, over the worker's
            try:
                await record(rt, range(STEPS), w.engine.model.config.vocab_size)
                first = trainer(
                    nats_server.url, config.run, log, crash_at="trainer.metrics_written@5"
                )
                assert await asyncio.to_thread(first.wait, 120) == -signal.SIGKILL, log.read_text()[
                    -3000:
                ]
                await eventually(
                    lambda: w.engine.version == STEPS,
                    f"the worker loaded v{STEPS} before the restart",
                )
                before = served(w.engine.model)
                checkpoint_path = tmp_path / "ckpt" / "rank0.pt"
                state = torch.load(checkpoint_path, weights_only=True)
                assert state["step"] == CHECKPOINT_EVERY, state["step"]
                # A retrained step that is not the one that died (as on a GPU):
                # other weights from here on.
                state["model"] = {
                    n: t + 1e-2 if t.is_floating_point() else t for n, t in state["model"].items()
                }
                torch.save(state, checkpoint_path)

                second = trainer(nats_server.url, config.run, log)
                assert await asyncio.to_thread(second.wait, 120) == 0, log.read_text()[-3000:]
                final = torch.load(checkpoint_path, weights_only=True)
                assert final["step"] == STEPS
                resumed = {name: final["model"][name] for name in before}
                assert not same_bits(before, resumed), (
                    "the restarted trainer's v5 equals the pre-crash one"
                )

                events = await weight_events(rt.js, topology)
                versions = [e.version for e in events]
                # v0..v5 before the kill, v4 and v5 again after it, each a distinct announcement.
                assert versions == [*range(STEPS + 1), *range(CHECKPOINT_EVERY + 1, STEPS + 1)], (
                    f"the weights stream holds versions {versions}: "
                    "the resumed trainer's were dropped as duplicates"
                )
                assert len({e.id for e in events}) == len(events), [e.id for e in events]
                if delta:  # the restart starts a new chain at its first version
                    assert [(e.base_version, e.full_version) for e in events[-2:]] == [
                        (None, 4),
                        (4, 4),
                    ]

                # The worker serves what the trainer holds, not the pre-crash v5.
                await eventually(
                    lambda: same_bits(served(w.engine.model), resumed) or w.engine.version > STEPS,
                    "the worker loaded the resumed trainer's v5",
                )
                assert w.engine.version == STEPS and same_bits(served(w.engine.model), resumed)
                assert w.rollout.receiver.served == events[-1].id

                # A retry of one announcement (the same event) is still stored once.
                ack = await rt.publisher.publish(WEIGHTS, events[-1])
                assert ack.duplicate, "a re-sent weight event was stored twice"
                assert len(await weight_events(rt.js, topology)) == len(events)
            finally:
                await rt.close()

    asyncio.run(scenario())


def test_weight_event_id_names_its_announcement() -> None:
    """The same announcement (from another process, at another time) has the same id; another
    location, base or checksum another id."""
    spec = {"name": "w", "dtype": "float32", "shape": [2], "sha256": "0" * 64}
    fields = {
        "run": "r",
        "version": 3,
        "step": 3,
        "location": "v3-0a0b0c0d.safetensors",
        "manifest": [spec],
        "total_bytes": 64,
    }
    event = WeightVersionEvent.announce(**fields)
    assert event.id.startswith("r/weights/3/")
    assert WeightVersionEvent.announce(**fields, time=1.0, source="other:1:trainer").id == event.id
    others = [
        {**fields, "location": "v3-0a0b0c0e.safetensors"},
        {**fields, "manifest": [{**spec, "sha256": "1" * 64}]},
        {**fields, "full_version": 3},
    ]
    assert len({event.id, *(WeightVersionEvent.announce(**o).id for o in others)}) == 4
