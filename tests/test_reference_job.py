"""The reference stage in the one-machine job: started by the launcher's fleet, killed -9 mid-run
(twice), and the run still finishes with nothing lost or duplicated; the trainer got reference
log-probs equal to its own frozen copy's, and the adaptive KL coefficient follows its recurrence
across a buffer kill, read back from the stream alone."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch
import yaml
from nats.js import JetStreamContext

from bus.connection import connect
from bus.crashpoints import (
    BUFFER_STEP_STORED,
    CRASH_AT,
    CRASH_RECORD,
    REFERENCE_MID_SCORING,
    REFERENCE_STORED_NOT_ACKED,
)
from bus.dead import STAGE
from bus.embedded import EmbeddedNats
from bus.security import USERS_FILE
from bus.topology import BATCHES, DEAD, REWARDS, SCORED, Topology
from consumers.buffer_replay import next_kl_coef
from consumers.trainer_dist import configured_engine
from engines.torch_train import LossConfig, TorchTrainEngine
from ops.audit import audit
from schemas import BatchEvent, RewardEvent, Rewards, decode
from schemas.config import RunConfig, parse_config

pytestmark = pytest.mark.slow  # a minute or more of real runs: -m 'not slow' skips it

ROOT = Path(__file__).resolve().parent.parent
STEPS = 8


def job_config(run: str) -> dict:
    config = yaml.safe_load((ROOT / "examples" / "digits.yaml").read_text())
    config["run"] = run
    config["trainer"] = {**config["trainer"], "steps": STEPS}
    config["algorithm"] = {
        **config["algorithm"],
        "prompts_per_step": 8,
        "kl_coef": 0.05,
        "kl_placement": "reward",
        "kl_target": 0.01,
        "kl_horizon": 200,
    }
    config["reference"] = {"enabled": True, "workers": 1, "batch": 4}
    config["streams"] = {"consumed": "keep"}  # rewards and scored stay, to be compared
    return config


async def read_all(js: JetStreamContext, subject: str, stream: str) -> list[bytes]:
    count = (await js.stream_info(stream)).state.messages
    sub = await js.subscribe(subject, ordered_consumer=True)
    try:
        return [(await sub.next_msg(timeout=10)).data for _ in range(count)]
    finally:
        await sub.unsubscribe()


async def inspect(
    url: str, admin: Path, cfg: RunConfig
) -> tuple[dict, list[RewardEvent], list[RewardEvent], list[BatchEvent], list[str]]:
    nc = await connect(url, "test-reference-job", identity=admin)
    js = nc.jetstream()
    topology = Topology.for_config(cfg)
    try:
        result = await audit(js, topology, cfg.staleness)
        rewards = [  # a sample's event, or each of a group's
            r
            for d in await read_all(js, topology.subject(REWARDS), topology.stream(REWARDS))
            for r in decode(d, Rewards).each()
        ]
        scored = [
            r
            for d in await read_all(js, topology.subject(SCORED), topology.stream(SCORED))
            for r in decode(d, Rewards).each()
        ]
        batches = [
            decode(d, BatchEvent)
            for d in await read_all(js, topology.subjects(BATCHES), topology.stream(BATCHES))
        ]
        stages = []
        if count := (await js.stream_info(topology.stream(DEAD))).state.messages:
            sub = await js.subscribe(topology.subjects(DEAD), ordered_consumer=True)
            stages = [(await sub.next_msg(timeout=10)).headers[STAGE] for _ in range(count)]  # type: ignore[index]  # a dead letter has headers
            await sub.unsubscribe()
    finally:
        await nc.close()
    return result, rewards, scored, batches, stages


@pytest.mark.timeout(600)
def test_reference_stage_survives_kill_9_and_the_trainer_gets_its_frozen_copys_logprobs(
    tmp_path: Path,
) -> None:
    run, out, record = f"ref{uuid.uuid4().hex[:8]}", tmp_path / "run", tmp_path / "crashes"
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(job_config(run)))
    record.mkdir()
    # Killed -9 twice (after storing a scored sample, before acking its reward; then mid-scoring
    # in its replacement), and the buffer once after a stored step: the fleet restarts each.
    env = {
        **os.environ,
        CRASH_RECORD: str(record),
        CRASH_AT: f"{REFERENCE_STORED_NOT_ACKED.name}@7,{REFERENCE_MID_SCORING.name}@40,"
        f"{BUFFER_STEP_STORED.name}@3",
    }
    job = subprocess.run(
        [sys.executable, "-m", "producers.prompts", "--config", str(path), "--out", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=480,
    )
    assert job.returncode == 0, job.stdout[-2000:] + job.stderr[-4000:]
    fired = sorted(p.name for p in record.iterdir())
    assert fired == sorted(
        [REFERENCE_STORED_NOT_ACKED.name, REFERENCE_MID_SCORING.name, BUFFER_STEP_STORED.name]
    ), fired
    logs = (out / "logs" / "reference-0.log").read_text()
    assert logs.count("scoring run") >= 3, "the reference worker was not restarted twice"

    cfg = parse_config(yaml.safe_load(path.read_text()))
    users = (out / "identities" / USERS_FILE).read_text()
    with EmbeddedNats(out / "nats", extra_config=users) as server:
        result, rewards, scored, batches, dead_stages = asyncio.run(
            inspect(server.url, out / "identities" / "admin.nk", cfg)
        )

    # Nothing lost, nothing twice: every prompt trained or dropped;
    # every reward scored exactly once.
    assert (
        result["in_flight"] == 0
        and result["duplicates"] == 0
        and result["batched_not_trained"] == 0
    ), result
    assert result["issued"] == result["trained"] + result["dropped"], result
    assert all(not n for n in result["lost"].values()) and set(result["lost"]) >= {
        "rewards",
        "scored",
    }, result
    assert result["without_reference"] == 0, result
    assert "reference" not in dead_stages, dead_stages
    assert len({s.id for s in scored}) == len(scored), "a scored sample stored twice"
    assert {s.id for s in scored} == {r.id for r in rewards}, (
        "a reward never scored, or a scored sample from nowhere"
    )
    assert all(s.ref_logprobs is not None for s in scored)

    # The trainer got reference log-probs equal to its own frozen copy's.
    engine = TorchTrainEngine(
        Path(cfg.model.path or out / "model"), lr=1e-3, loss=LossConfig(kl_coef=1.0)
    )
    assert engine.reference is not None
    steps = sorted({b.step for b in batches})
    assert steps == list(range(STEPS))
    for batch in batches:
        assert batch.ref_logprobs is not None
        ids, mask = batch.input_ids.torch().long(), batch.attention_mask.torch().long()
        with torch.no_grad():
            own, _ = engine._token_logprobs(ids, mask, entropy=False, model=engine.reference)
        loss = batch.loss_mask.torch() > 0
        torch.testing.assert_close(batch.ref_logprobs.torch()[loss], own[loss], atol=1e-5, rtol=0)

    # The adaptive coefficient: step 0 at kl_coef, each next one from the step before, as stored.
    per_step = {
        b.step: (
            b.kl_coef,
            b.kl_mean,
            len(set().union(*(x.sample_ids for x in batches if x.step == b.step))),
        )
        for b in batches
    }
    assert per_step[0][0] == pytest.approx(cfg.algorithm.kl_coef)
    for step in range(1, STEPS):
        coef, kl_mean, samples = per_step[step - 1]
        assert per_step[step][0] == pytest.approx(
            next_kl_coef(cfg.algorithm, coef, kl_mean, samples), rel=1e-9
        )
    # Every step's batch carries its coefficient (compared with approx above).
    assert len({round(c, 12) for c, _, _ in per_step.values()}) > 1, "the coefficient never moved"  # type: ignore[arg-type]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["kl_coef"] for m in metrics] == pytest.approx([per_step[s][0] for s in range(STEPS)])


def test_the_trainer_holds_no_reference_copy_when_the_stage_scores_it(tmp_path: Path) -> None:
    from engines.tiny import build_tiny_model
    from producers.tasks import VOCAB

    build_tiny_model(tmp_path / "model", VOCAB, hidden=16, layers=1, seed=0)
    base = {"model": {"path": str(tmp_path / "model")}, "algorithm": {"kl_coef": 0.1}}
    for enabled, holds in ((False, True), (True, False)):
        cfg = parse_config({**base, "reference": {"enabled": enabled}})
        engine = configured_engine(cfg, LossConfig(kl_coef=0.1), torch.device("cpu"))
        assert isinstance(engine, TorchTrainEngine)
        assert (engine.reference is not None) is holds
