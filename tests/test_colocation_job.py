"""`placement: colocated` as the whole local job: real processes (producer, rollout on the
simulated engine with a simulated device memory or on the HF engine, reward, buffer, torch
trainer) on a real nats-server, the rollout and the trainer sharing the node's one device in
turns.

- sync (verl's hybrid engine) and async: the run trains every sample it should, and from
  the timeline the phases record no phase ever starts while the other holds the device;
- the real HF engine colocated: its weights leave and come back each turn, and its samples'
  log-probs are still the trainer's; with the versions handed over through the object store,
  and through shared memory (a tmpfs: the filesystem transport under /dev/shm);
- a kill -9 in each phase (the rollout holding the device, then the trainer holding it): the
  fleet restarts each, the dead holder's lease ends with its membership, and the run still
  trains every sample, the timeline still never overlapping; with `trainer.offload_optimizer`
  on, its optimizer state leaving the device at the end of every turn (after the restarted
  trainer's checkpoint load too) and coming back whole.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from bus.crashpoints import (
    CRASH_AT,
    CRASH_RECORD,
    ROLLOUT_HOLDING_DEVICE,
    TRAINER_HOLDING_DEVICE,
    records,
)
from consumers.colocation import PHASE_LOG
from producers.report import METRICS_FILE
from tests.helpers import run_local_job
from tests.phase_timeline import assert_exclusive, phase_intervals, read_timeline

pytestmark = pytest.mark.slow  # a minute or more of real runs each

PER_STEP, N, STEPS = 4, 2, 3
GAP = 1e-4
"""The most mean |log pi - log pi_behaviour| a sync step may show: float error only."""


def colocated(mode: str) -> dict[str, Any]:
    return {
        "run": f"coloc{mode}",
        "mode": mode,
        "placement": "colocated",
        "data": {"n": N, "sampling": {"max_tokens": 16}},
        "algorithm": {"prompts_per_step": PER_STEP, "drop_equal_reward_groups": False},
        "rollout": {
            "continuous": False,
            "engine": {
                "type": "simulated",
                "median_tokens": 8,
                "seconds_per_token": 0.01,
                "memory_mib": 64,
                "sleep_seconds": 0.05,
                "wake_seconds": 0.05,
            },
        },
        "trainer": {"steps": STEPS, "checkpoint_every": 1},
    }


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_colocated_run_takes_turns_and_trains_every_sample(tmp_path: Path, mode: str) -> None:
    log = tmp_path / "phases.jsonl"
    job = run_local_job(
        colocated(mode), tmp_path, STEPS, timeout=240, env={**clean_env(), PHASE_LOG: str(log)}
    )
    assert job.summary["samples_trained"] == STEPS * PER_STEP * N
    timeline = read_timeline(log)
    assert_exclusive(phase_intervals(timeline, {}))
    trained = [p for p in timeline if p["phase"] == "train" and p["event"] == "end"]
    assert len(trained) >= STEPS  # setup (v0 out), then a turn per step
    if mode == "sync":
        assert job.summary["staleness_max_seen"] == 0


@pytest.mark.timeout(420)
def test_a_colocated_run_killed_in_each_phase_loses_nothing(tmp_path: Path) -> None:
    """The trainer offloads its optimizer state here (`trainer.offload_optimizer`): a run of
    its own would cost a minute more of CI for what this one shows as well, the restart from a
    checkpoint included."""
    log, crashes = tmp_path / "phases.jsonl", tmp_path / "crashes"
    env = {
        **clean_env(),
        PHASE_LOG: str(log),
        CRASH_RECORD: str(crashes),
        CRASH_AT: f"{ROLLOUT_HOLDING_DEVICE.name}@3,{TRAINER_HOLDING_DEVICE.name}@3",
    }
    config = colocated("sync")
    config["trainer"]["offload_optimizer"] = True
    job = run_local_job(config, tmp_path, STEPS, timeout=360, env=env)
    fired = records(crashes)
    assert sorted(fired) == sorted([ROLLOUT_HOLDING_DEVICE.name, TRAINER_HOLDING_DEVICE.name])
    assert job.summary["samples_trained"] == STEPS * PER_STEP * N
    kills: list[dict[str, Any]] = list(fired.values())
    killed = {int(r["pid"]): float(r["time"]) for r in kills}
    assert_exclusive(phase_intervals(read_timeline(log), killed))
    trainer = "".join(text for name, text in sorted(job.logs.items()) if name.startswith("train"))
    released = re.findall(r"optimizer state released \(([\d.]+) MiB", trainer)
    resumed = re.findall(r"optimizer state resumed \(([\d.]+) MiB", trainer)
    print("optimizer state released:", released, "resumed:", resumed)
    # Each step's turn ends with a release (and the restarted trainer's first, after its load);
    # every step after the first starts with a resume; the state's size never changes.
    assert len(released) >= STEPS and len(resumed) >= STEPS - 1, (released, resumed)
    assert len({*released, *resumed}) == 1 and float(released[0]) > 0, (released, resumed)


SHM = Path("/dev/shm")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("handoff", ["object_store", "shared_memory"])
def test_a_colocated_run_on_the_hf_engine_generates_with_each_version_it_announces(
    tmp_path: Path, handoff: str
) -> None:
    """The real HF engine colocated (sync), in the whole job: it gives its memory back at the
    end of each of its turns and takes it again at the start of the next (its weights spilled
    to a file and read back each time), and its samples' log-probs are still the trainer's
    (`logprob_gap` ~ float error): the weights came back as they left, and each version it
    announces is the one it generates with. Whether a version arrives while the engine is
    released or while it holds the device is a race here; tests/test_release.py makes one
    arrive while it is released.

    shared_memory: the versions go to the engine as files in a tmpfs (`weights.transport:
    filesystem`, `weights.dir` under /dev/shm): the trainer writes each once, the engine maps
    the same pages, and the bus carries only the announcement."""
    config = colocated("sync")
    config["run"] = f"colochf{handoff.replace('_', '')}"
    config["rollout"] = {"continuous": False, "engine": "hf"}
    shm: Path | None = None
    if handoff == "shared_memory":
        if not SHM.is_dir() or not os.access(SHM, os.W_OK):
            pytest.skip("no writable /dev/shm (a tmpfs) on this machine")
        shm = SHM / f"jetrl-test-{os.getpid()}-{tmp_path.name}"
        config["weights"] = {"transport": "filesystem", "dir": str(shm)}
    log = tmp_path / "phases.jsonl"
    try:
        job = run_local_job(
            config, tmp_path, STEPS, timeout=240, env={**clean_env(), PHASE_LOG: str(log)}
        )
        if shm is not None:
            kept = sorted(p.name for p in shm.rglob("v*.safetensors"))
            assert kept, f"no version was written to the shared memory under {shm}"
    finally:
        if shm is not None:
            shutil.rmtree(shm, ignore_errors=True)
    assert job.summary["samples_trained"] == STEPS * PER_STEP * N
    assert_exclusive(phase_intervals(read_timeline(log), {}))
    steps = [json.loads(line) for line in (job.out / METRICS_FILE).read_text().splitlines()]
    gaps = [m["logprob_gap"] for m in steps]
    print("logprob_gap per step:", gaps)
    assert len(gaps) == STEPS and max(gaps) < GAP, gaps


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in (CRASH_AT, CRASH_RECORD, PHASE_LOG)}
