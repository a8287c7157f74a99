"""`lend: true` as the whole local job: real processes (producer, one rollout worker on a slow
simulated engine, reward, buffer, a fast torch trainer) on a real nats-server. The trainer
waits for its batches, lends its device to rollout after `trainer.lend_after`, and hands it
back when each step's batches come.

- the run trains every sample it should, within the staleness bound, and the lent rollout
  stored some of them (the prompts it took are ordinary prompts: durable, acked once stored);
- each hand-back stops the lent engine within one generation step (`seconds_per_token` of
  the simulated engine) of the batch's arrival, measured by the trainer
  (`JETRL_PHASE_LOG`, phase "lend": `stopped`);
- the lent rollout is traced as any rollout: its generations sit in their prompts' traces,
  under the trainer's `process` span of the prompt, beside the buffer's admission;
- a kill -9 of the trainer while it lends (its batches in, its lent prompts held): the fleet
  restarts it, the prompts come back to the queue, and the run still trains every sample.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from bus.crashpoints import CRASH_AT, CRASH_RECORD, TRAINER_LENDING, records
from consumers.colocation import PHASE_LOG
from tests.fake_jaeger import FakeJaeger
from tests.helpers import run_local_job
from tests.phase_timeline import read_timeline

pytestmark = pytest.mark.slow  # a minute of real runs

PER_STEP, N, STEPS = 4, 2, 4
TOKEN = 0.05
"""Seconds one simulated token takes: one generation step."""
SLACK = 0.03
"""Seconds of scheduling on a loaded machine: waking the pausing thread and the event loop."""
OTLP = "OTEL_EXPORTER_OTLP_ENDPOINT"


def lending() -> dict[str, Any]:
    return {
        "run": "lend",
        "mode": "async",
        "lend": True,
        "data": {"n": N, "sampling": {"max_tokens": 24}},
        "algorithm": {"prompts_per_step": PER_STEP, "drop_equal_reward_groups": False},
        # The rollout worker holds at most 2 x slots prompts (continuous admission, one prompt
        # a batch): the gate admits 2 steps' worth (max_staleness 1), so some are left to lend.
        "rollout": {
            "max_batch_prompts": 1,
            "engine": {
                "type": "simulated",
                "median_tokens": 8,
                "seconds_per_token": TOKEN,
                "slots": 2,
                "memory_mib": 64,
            },
        },
        "trainer": {"steps": STEPS, "checkpoint_every": 1, "lend_after": 0.3},
    }


@pytest.mark.timeout(300)
def test_a_waiting_trainer_lends_its_device_and_hands_it_back_within_a_token(
    tmp_path: Path,
) -> None:
    log = tmp_path / "phases.jsonl"
    env = {k: v for k, v in os.environ.items() if k != PHASE_LOG and not k.startswith("OTEL_")}
    env |= {PHASE_LOG: str(log), "OTEL_BSP_SCHEDULE_DELAY": "200"}
    with FakeJaeger() as jaeger:
        job = run_local_job(lending(), tmp_path, STEPS, timeout=240, env=env | {OTLP: jaeger.url})
    assert job.summary["samples_trained"] == STEPS * PER_STEP * N
    lent_rollout_is_traced(jaeger)
    assert job.summary["staleness_max_seen"] <= 1
    lends = [line for line in read_timeline(log) if line["phase"] == "lend"]
    handbacks = [line for line in lends if line["event"] == "end"]
    assert handbacks, f"the trainer never handed a lent device back: {lends}"
    assert max(line["prompts"] for line in handbacks) > 0, "the lent rollout stored nothing"
    stopped = [float(line["stopped"]) for line in handbacks]
    print(f"hand-backs: stopped {stopped}, released {[line['released'] for line in handbacks]}")
    assert max(stopped) <= TOKEN + SLACK, (
        f"the lent engine stopped {max(stopped):.3f} s after the batch came: more than one "
        f"generation step ({TOKEN} s)"
    )


def lent_rollout_is_traced(jaeger: FakeJaeger) -> None:
    """The trainer's lent generations are ordinary rollout in the prompt's trace: under its
    `process <prompts>` span, with the producer's `prompt` span at the root and the buffer's
    admission (`outcome`) of what it generated in the same trace."""
    spans = list(jaeger.spans)
    lent = [s for s, p in spans if s["operationName"] == "generate" and is_trainer(p)]
    assert lent, "no generate span from the trainer: the lent rollout was not traced"
    for generate in lent:
        trace = {s["spanID"]: (s, p) for s, p in spans if s["traceID"] == generate["traceID"]}
        parent_id = generate["references"][0]["spanID"] if generate["references"] else None
        assert parent_id in trace, "the lent generation has no parent in the prompt's trace"
        parent, process = trace[parent_id]
        assert parent["operationName"].endswith(".prompts") and is_trainer(process), parent
        names = {(s["operationName"], p["serviceName"]) for s, p in trace.values()}
        assert ("prompt", "jetrl-producer") in names, sorted(names)
        assert ("outcome", "jetrl-buffer") in names, sorted(names)


def is_trainer(process: dict[str, Any]) -> bool:
    return bool(process["serviceName"] == "jetrl-trainer")


@pytest.mark.timeout(400)
def test_a_trainer_killed_while_lending_loses_nothing(tmp_path: Path) -> None:
    crashes = tmp_path / "crashes"
    env = {k: v for k, v in os.environ.items() if k not in (PHASE_LOG, CRASH_AT)} | {
        CRASH_AT: f"{TRAINER_LENDING.name}@2",
        CRASH_RECORD: str(crashes),
    }
    job = run_local_job(lending(), tmp_path, STEPS, timeout=360, env=env)
    fired = records(crashes)
    assert list(fired) == [TRAINER_LENDING.name], fired
    assert job.summary["samples_trained"] == STEPS * PER_STEP * N
    assert job.summary["staleness_max_seen"] <= 1
