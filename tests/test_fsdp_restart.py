"""Two FSDP2 trainer ranks lose one: the group is rebuilt and both resume from the checkpoint.

A recorded batch stream (the buffer's own `publish_step`, split over 2 ranks) feeds two
trainer processes that meet through the run's KV. Once both have trained KILL_AFTER steps
(their checkpoint holds CHECKPOINT_EVERY), rank 1 is SIGKILLed and started again, while rank 0
sits idle waiting for the next step's batches. Rank 0 must notice by itself (its group watch
sees rank 1 claimed twice) and exit 1 with one line; started again, it hosts a new generation
that the waiting rank 1 joins; both load the checkpoint, retrain the steps after it and
finish the run. Every step's loss on both ranks then equals the single-process engine's on the
union of the step's micro-batches, and the update history holds every sample once. Each rank
trims its batch subject after each committed checkpoint: at the end, step 5 on is stored.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import cast

import numpy as np
import pytest
import torch
from nats.aio.msg import Msg
from nats.js.errors import KeyNotFoundError

from bus.embedded import EmbeddedNats
from bus.runtime import Runtime
from bus.topology import BATCHES, metrics_key
from consumers.trainer_steps import loss_config, micro_batch
from consumers.update_history import UpdateHistory
from engines.tiny import build_tiny_model
from engines.torch_train import TorchTrainEngine
from producers.launcher import attach_bootstrap
from producers.tasks import VOCAB
from schemas import BatchEvent, decode
from schemas.config import RunConfig
from tests.test_trainer_resume import GROUP, PROMPTS_PER_STEP, record

ROOT = Path(__file__).resolve().parent.parent
STEPS, CHECKPOINT_EVERY, KILL_AFTER = 7, 3, 5
"""Killed after step index 4: the checkpoint holds 3 steps, steps 3 and 4 are retrained."""
LEAVE_WITHIN = 45.0
"""Seconds from rank 1's restart for rank 0 to leave the broken group: the replacement's start-up
(torch imports, ~5-10 s on 2 busy cores) plus one watch period (2 s), with room to spare."""


def run_config(run: str, model: Path, checkpoints: Path) -> RunConfig:
    return RunConfig.model_validate(
        {
            "run": run,
            "model": {"path": str(model)},
            "data": {"n": GROUP},
            "algorithm": {"prompts_per_step": PROMPTS_PER_STEP},
            "trainer": {
                "steps": STEPS,
                "checkpoint_every": CHECKPOINT_EVERY,
                "micro_batch_tokens": 64,
                "checkpoint_dir": str(checkpoints),
                "engine": "fsdp",
                "dp_size": 2,
                "dist_timeout": 60,
            },
        }
    )


def trainer(url: str, run: str, rank: int, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "consumers.trainer",
                "--run",
                run,
                "--nats",
                url,
                "--rank",
                str(rank),
            ],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


async def recorded(rt: Runtime, rank: int, step: int) -> dict | None:
    try:
        return json.loads((await rt.kv.get(metrics_key(rank, step))).value or b"")
    except KeyNotFoundError:
        return None


async def wait_for(
    rt: Runtime, step: int, procs: list[subprocess.Popen[bytes]], timeout: float = 90
) -> None:
    """Until both ranks have recorded `step`."""
    deadline = time.monotonic() + timeout
    while await recorded(rt, 0, step) is None or await recorded(rt, 1, step) is None:
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline, (
            f"no step {step}"
        )
        await asyncio.sleep(0.2)


async def steps_of_stream(rt: Runtime) -> dict[int, list[BatchEvent]]:
    """Every stored micro-batch, by step, rank 0's first."""
    info = await rt.js.stream_info(rt.topology.stream(BATCHES))
    sub = await rt.js.subscribe(rt.topology.subject(BATCHES, ">"), ordered_consumer=True)
    found: dict[int, list[BatchEvent]] = {}
    for _ in range(info.state.messages):
        batch = decode((await sub.next_msg(timeout=10)).data, BatchEvent)
        found.setdefault(batch.step, []).append(batch)
    await sub.unsubscribe()
    return {
        step: sorted(bs, key=lambda b: (b.dp_rank, b.micro_index)) for step, bs in found.items()
    }


@pytest.mark.timeout(300)
def test_a_killed_rank_breaks_the_group_and_both_resume(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    model = build_tiny_model(tmp_path / "model", VOCAB, seed=0)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    run = f"fsdp-restart-{uuid.uuid4().hex[:8]}"
    cfg = run_config(run, model, tmp_path / "checkpoints")
    logs = [tmp_path / f"rank{r}.log" for r in range(2)]

    async def scenario() -> tuple[
        list[list[dict]], float, dict[int, list[BatchEvent]], dict[int, list[BatchEvent]]
    ]:
        rt = await attach_bootstrap(cfg, nats_server.url)
        sent: dict[int, list[BatchEvent]] = {}

        async def keep(msg: Msg) -> None:  # every batch as it is stored: the ranks trim the stream
            batch = decode(msg.data, BatchEvent)
            sent.setdefault(batch.step, []).append(batch)

        watching = await rt.nc.subscribe(rt.topology.subject(BATCHES, ">"), cb=keep)
        await record(rt, range(KILL_AFTER), vocab)
        procs = [trainer(nats_server.url, run, r, logs[r]) for r in range(2)]
        try:
            await wait_for(rt, KILL_AFTER - 1, procs)
            procs[1].kill()
            procs[1].wait()
            procs[1] = trainer(nats_server.url, run, 1, logs[1])
            restarted = time.monotonic()
            # Rank 0 waits for step KILL_AFTER's batches, which are not there:
            # only its watch can end it.
            while procs[0].poll() is None and time.monotonic() - restarted < LEAVE_WITHIN:
                await asyncio.sleep(0.2)
            noticed = time.monotonic() - restarted
            assert procs[0].poll() == 1, (
                f"rank 0 still in its broken group after {noticed:.0f}s, or not exit 1"
            )
            assert (
                "rank 1 restarted: the process group is broken, all ranks restart"
                in logs[0].read_text()
            )
            procs[0] = trainer(nats_server.url, run, 0, logs[0])
            await record(rt, range(KILL_AFTER, STEPS), vocab)
            for r, proc in enumerate(procs):
                assert await asyncio.to_thread(proc.wait, 180) == 0, logs[r].read_text()[-3000:]
        finally:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
        records = [[await recorded(rt, r, s) for s in range(STEPS)] for r in range(2)]
        kept = await steps_of_stream(rt)
        await watching.unsubscribe()
        await rt.close()
        stream = {
            step: sorted(bs, key=lambda b: (b.dp_rank, b.micro_index)) for step, bs in sent.items()
        }
        # Every step was recorded (both ranks finished); a missing one fails the checks below.
        return cast(list[list[dict]], records), noticed, stream, kept

    records, noticed, stream, kept = asyncio.run(scenario())
    # Each rank trimmed its own subject once the checkpoint at 6 steps was committed on both: step 5
    # on stay (the run's end trims nothing).
    assert {step: {b.dp_rank for b in bs} for step, bs in kept.items()} == {5: {0, 1}, 6: {0, 1}}, (
        sorted(kept)
    )
    print(f"rank 0 left the broken group {noticed:.1f}s after rank 1's replacement started")
    # The steps after the checkpoint were trained twice (before the kill and after); the final
    # records are those of the resumed group, equal to one process on each step's union.
    engine = TorchTrainEngine(
        model, lr=cfg.algorithm.lr, seed=cfg.trainer.seed, loss=loss_config(cfg)
    )
    single = [engine.train_step([micro_batch(b) for b in stream[step]]) for step in range(STEPS)]
    assert {b.dp_rank for step in stream.values() for b in step} == {0, 1}
    for rank in range(2):
        for name in ("loss", "grad_norm", "tokens"):
            np.testing.assert_allclose(
                [m[name] for m in records[rank]],
                [m[name] for m in single],
                rtol=1e-5,
                atol=1e-7,
                err_msg=f"rank {rank}: {name}",
            )
    # Each rank's update history holds its own samples once; together, every sample once.
    trained = [[sid for m in records[rank] for sid in m["sample_ids"]] for rank in range(2)]
    for rank in range(2):
        own = torch.load(
            next((tmp_path / "checkpoints" / "fsdp.pt.d").iterdir()) / f"rank{rank}.pt",
            weights_only=True,
        )
        assert UpdateHistory.from_dict(own["extra"]["history"]) == UpdateHistory.of_steps(
            [m["sample_ids"] for m in records[rank]]
        )
    everything = trained[0] + trained[1]
    assert len(set(everything)) == len(everything) == STEPS * PROMPTS_PER_STEP * GROUP
