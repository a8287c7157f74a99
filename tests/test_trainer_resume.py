"""A trainer killed and restarted from its checkpoint continues from the next batch in the stream.

One recorded batch stream (the buffer's own `publish_step` over seeded scored samples) is
stored under two runs. Trainer A trains it uninterrupted. Trainer B gets the first KILL_AFTER
steps, is SIGKILLed once it has trained them (its last checkpoint is CHECKPOINT_EVERY steps
in, so it has trained steps beyond it that die with it), gets the rest, and is restarted.
Both runs' per-step losses (KV `metrics.0.<step>`) must match to float tolerance: the
restarted trainer retrained from the checkpoint on exactly the batches after it, with the
same model, optimizer and RNG state. Deterministic: same seeds, one torch thread, no rollout.
With `algorithm.advantage: gae` the critic and its optimizer must come back too: the policy's
advantages and the value loss of every retrained step depend on them.

Retention (issue 15): after each committed checkpoint but the run's last, the trainer deletes
the batches no restart can need. At B's kill and at both runs' end the batch stream must hold
exactly the last trimming checkpoint's last step and what follows it: every batch after the
checkpoint's last sequence (what B's restart reads, and it then resumes exactly), and the
last step whole (what a restarted buffer learns its next step from).

Those runs are subprocesses: a trim or a resume that goes wrong leaves one waiting for
batches that are gone, and it fails by timing out. The two in-process tests at the end check
the same claims at the moment they are decided, by assertion, in seconds: each trim deletes
only what the checkpoint in force when it runs (the one on disk) cannot need, and a trainer
resumed from a checkpoint starts at its step and reads first the batch after its last sequence.
"""

from __future__ import annotations

import asyncio
import json
import signal
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

from bus import readers
from bus.embedded import EmbeddedNats
from bus.runtime import Runtime
from bus.topology import BATCHES, metrics_key
from consumers.buffer import BatchedSoFar, Buffer, Group, read_batches
from consumers.trainer import Trainer
from consumers.update_history import UpdateHistory
from engines.tiny import build_tiny_model
from producers.launcher import attach_bootstrap
from producers.tasks import VOCAB
from schemas import BatchEvent, RewardEvent, Tensor, TrajectoryEvent, decode
from schemas.config import RunConfig

ROOT = Path(__file__).resolve().parent.parent
STEPS, CHECKPOINT_EVERY, KILL_AFTER = 8, 3, 5
"""B is killed after step index 4: its checkpoint holds 3 steps, steps 3 and 4 are retrained."""
PROMPTS_PER_STEP, GROUP = 2, 4
MICRO = 2
"""Micro-batches a step (64 tokens each at most): step s is stored at sequences 2s+1 and 2s+2."""


def steps_of(first: int, last: int) -> list[tuple[int, int]]:
    """(sequence, step) of every micro-batch of steps first .. last, as `record` stores them."""
    return [(MICRO * step + i + 1, step) for step in range(first, last + 1) for i in range(MICRO)]


def run_config(run: str, model: Path, checkpoints: Path, advantage: str = "grpo") -> RunConfig:
    return RunConfig.model_validate(
        {
            "run": run,
            "model": {"path": str(model)},
            "data": {"n": GROUP},
            "algorithm": {"prompts_per_step": PROMPTS_PER_STEP, "advantage": advantage},
            # 64 tokens: two micro-batches a step, so the restart also re-assembles steps.
            "trainer": {
                "steps": STEPS,
                "checkpoint_every": CHECKPOINT_EVERY,
                "micro_batch_tokens": 64,
                "checkpoint_dir": str(checkpoints),
            },
        }
    )


def scored_group(run: str, step: int, prompt: int, rng: np.random.Generator, vocab: int) -> Group:
    """One prompt's GROUP scored samples; the same `rng` state gives the same samples in any run."""
    prompt_id = f"{run}/0/{step * PROMPTS_PER_STEP + prompt}"
    group = Group(prompt_id, GROUP)
    prompt_ids = rng.integers(1, vocab, size=5).astype(np.int32)
    for index in range(GROUP):
        response = rng.integers(1, vocab, size=int(rng.integers(2, 7))).astype(np.int32)
        trajectory = TrajectoryEvent(
            id=f"{prompt_id}/{index}",
            run=run,
            prompt_id=prompt_id,
            sample_index=index,
            group_size=GROUP,
            prompt_ids=Tensor.from_numpy(prompt_ids),
            response_ids=Tensor.from_numpy(response),
            # A random-init model is near uniform: behaviour log-probs near log(1/V) keep ratios
            # near 1.
            logprobs=Tensor.from_numpy(np.full(len(response), -np.log(vocab), np.float32)),
            versions=Tensor.from_numpy(np.zeros(len(response), np.int32)),
            response_text="",
            task={},
        )
        reward = RewardEvent(
            id=trajectory.id, run=run, trajectory=trajectory, reward=float(rng.random())
        )
        group.samples[index] = (reward, Msg(_client=None))  # type: ignore[arg-type]  # only its headers are read
    return group


async def record(rt: Runtime, steps: range, vocab: int) -> None:
    """Publish `steps` of the stream as the buffer would, from samples seeded by step."""
    buffer = Buffer(rt, BatchedSoFar())
    for step in steps:
        rng = np.random.default_rng(step)
        await buffer.publish_step(
            step,
            [scored_group(rt.topology.run, step, p, rng, vocab) for p in range(PROMPTS_PER_STEP)],
        )


async def stored(rt: Runtime) -> list[tuple[int, int]]:
    """(sequence, step) of every batch still in the run's stream, in order."""
    count = (await rt.js.stream_info(rt.topology.stream(BATCHES))).state.messages
    sub = await rt.js.subscribe(rt.topology.subject(BATCHES, ">"), ordered_consumer=True)
    try:
        msgs = [await sub.next_msg(timeout=10) for _ in range(count)]
    finally:
        await sub.unsubscribe()
    return [(m.metadata.sequence.stream, decode(m.data, BatchEvent).step) for m in msgs]


def trainer(url: str, run: str, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "consumers.trainer", "--run", run, "--nats", url],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


async def metrics(rt: Runtime, step: int) -> dict | None:
    try:
        entry = await rt.kv.get(metrics_key(0, step))
    except KeyNotFoundError:
        return None
    return json.loads(entry.value or b"")


async def wait_for_step(
    rt: Runtime, step: int, proc: subprocess.Popen[bytes], timeout: float = 60.0
) -> None:
    deadline = time.monotonic() + timeout
    while await metrics(rt, step) is None:
        assert proc.poll() is None and time.monotonic() < deadline, (
            f"{rt.topology.run}: no step {step}"
        )
        await asyncio.sleep(0.1)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("advantage", ["grpo", "gae"])
def test_restarted_trainer_continues_from_the_next_batch(
    nats_server: EmbeddedNats, tmp_path: Path, advantage: str
) -> None:
    model = build_tiny_model(tmp_path / "model", VOCAB, seed=0)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    runs = {name: f"resume-{name}-{uuid.uuid4().hex[:8]}" for name in ("a", "b")}

    Stored = list[tuple[int, int]]

    async def scenario() -> tuple[
        dict[str, list[dict]], float, dict, Stored, dict[str, Stored], BatchedSoFar
    ]:
        # Declared and configured as the producer does it; the runtime publishes the batches.
        rts = {
            name: await attach_bootstrap(
                run_config(run, model, tmp_path / name, advantage), nats_server.url
            )
            for name, run in runs.items()
        }
        await record(rts["a"], range(STEPS), vocab)
        await record(rts["b"], range(KILL_AFTER), vocab)
        procs = {
            name: trainer(nats_server.url, run, tmp_path / f"{name}.log")
            for name, run in runs.items()
        }
        try:
            await wait_for_step(rts["b"], KILL_AFTER - 1, procs["b"])
            procs["b"].send_signal(signal.SIGKILL)
            procs["b"].wait()
            killed_at = time.time()
            # B's checkpoint (3 steps: its last sequence is step 2's last) is in force: steps 0
            # and 1 are gone; step 2 stays for the buffer, steps 3 and 4 for B's restart.
            checkpoint = torch.load(tmp_path / "b" / "rank0.pt", weights_only=True)
            assert checkpoint["extra"]["last_seq"] == steps_of(0, CHECKPOINT_EVERY - 1)[-1][0]
            at_kill = await stored(rts["b"])
            await record(rts["b"], range(KILL_AFTER, STEPS), vocab)
            procs["b"] = trainer(nats_server.url, runs["b"], tmp_path / "b.log")
            for name, proc in procs.items():
                assert await asyncio.to_thread(proc.wait, 90) == 0, (
                    tmp_path / f"{name}.log"
                ).read_text()[-3000:]
        finally:
            for proc in procs.values():
                if proc.poll() is None:
                    proc.kill()
        curves = {
            name: [await metrics(rt, step) for step in range(STEPS)] for name, rt in rts.items()
        }
        history = torch.load(tmp_path / "b" / "rank0.pt", weights_only=True)["extra"]["history"]
        at_end = {name: await stored(rt) for name, rt in rts.items()}
        replayed = await read_batches(rts["a"])
        for rt in rts.values():
            await rt.close()
        # Every step was recorded (both runs finished); a missing one fails the checks below.
        return cast(dict[str, list[dict]], curves), killed_at, history, at_kill, at_end, replayed

    curves, killed_at, history, at_kill, at_end, replayed = asyncio.run(scenario())
    assert at_kill == steps_of(CHECKPOINT_EVERY - 1, KILL_AFTER - 1), (
        f"at B's kill the stream held (sequence, step) {at_kill}: "
        "the checkpoint's last step and every batch after it must stay, nothing before"
    )
    # The run's end trims nothing: what the last checkpoint before it (6 steps) kept stays,
    # in both runs.
    last_trim = (STEPS - 1) // CHECKPOINT_EVERY * CHECKPOINT_EVERY  # 6
    for name, kept in at_end.items():
        assert kept == steps_of(last_trim - 1, STEPS - 1), (
            f"{name}: at the end the stream held {kept}"
        )
    # A buffer restarted now learns the next step from what is left, not step 0,
    # and no step half stored.
    assert (replayed.next_step, replayed.partial) == (STEPS, None), (
        replayed.next_step,
        replayed.partial,
    )
    a, b = curves["a"], curves["b"]
    # Steps inside B's checkpoint were trained once, before the kill; the rest after it.
    assert [m["time"] < killed_at for m in b] == [step < CHECKPOINT_EVERY for step in range(STEPS)]
    np.testing.assert_allclose([m["loss"] for m in b], [m["loss"] for m in a], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose([m["grad_norm"] for m in b], [m["grad_norm"] for m in a], rtol=1e-5)
    if advantage == "gae":
        for name in ("value_loss", "value_mean", "critic_grad_norm"):
            np.testing.assert_allclose(
                [m[name] for m in b], [m[name] for m in a], rtol=1e-5, atol=1e-7, err_msg=name
            )
        assert b[-1]["value_mean"] != 0.0, "the critic trained"
    # The final model's update history holds every sample of the stream once, in order: the
    # checkpoint's hash chain is that of the steps' own records, and those hold no repeat.
    assert UpdateHistory.from_dict(history) == UpdateHistory.of_steps([m["sample_ids"] for m in b])
    trained = [sid for m in b for sid in m["sample_ids"]]
    assert len(set(trained)) == len(trained) == STEPS * PROMPTS_PER_STEP * GROUP
    assert set(history) == {"steps", "samples", "digest"}, (
        "the checkpoint keeps no list that grows with the run"
    )


def in_force(path: Path) -> tuple[int, int] | None:
    """(step, last sequence) of the checkpoint on disk at `path`: the one a restart resumes
    from; None if there is none yet (a restart starts at step 0, sequence 1)."""
    if not path.exists():
        return None
    state = torch.load(path, weights_only=True)
    return state["step"], state["extra"]["last_seq"]


def first_seq(step: int) -> int:
    return steps_of(step, step)[0][0]


def last_seq(step: int) -> int:
    return steps_of(step, step)[-1][0]


@pytest.mark.timeout(120)
def test_each_trim_deletes_only_what_the_checkpoint_in_force_cannot_need(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    """Trainer in process over STEPS recorded steps; every purge of its batch subject is
    checked against the checkpoint on disk at that moment. A restart from that checkpoint
    (step C, last sequence L) reads from L + 1, and a restarted buffer needs step C - 1 whole:
    the purge may delete only what is stored before step C - 1's first sequence."""
    model = build_tiny_model(tmp_path / "model", VOCAB, seed=0)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    run = f"trim-{uuid.uuid4().hex[:8]}"

    async def scenario() -> tuple[list[tuple[int, tuple[int, int] | None]], list[tuple[int, int]]]:
        cfg = run_config(run, model, tmp_path / "checkpoints")
        rt = await attach_bootstrap(cfg, nats_server.url)
        await record(rt, range(STEPS), vocab)
        trainer = Trainer(rt, 0)
        purges: list[tuple[int, tuple[int, int] | None]] = []
        purge = rt.js.purge_stream

        async def watched_purge(
            name: str, seq: int | None = None, subject: str | None = None, keep: int | None = None
        ) -> bool:
            if name == rt.topology.stream(BATCHES):  # the object store purges too (old versions)
                assert subject == rt.topology.subject(BATCHES, 0) and seq, (subject, seq)
                purges.append((seq, in_force(trainer.checkpoint_path)))
            return await purge(name, seq=seq, subject=subject, keep=keep)

        rt.js.purge_stream = watched_purge  # type: ignore[method-assign]
        try:
            # The deadline only guards a hang: the run takes a few seconds.
            await asyncio.wait_for(trainer.run(asyncio.Event()), 90)
            assert trainer.done(), f"the trainer stopped at step {trainer.engine.step} of {STEPS}"
        finally:
            await trainer.close()
        left = await stored(rt)
        await rt.close()
        return purges, left

    purges, left = asyncio.run(scenario())
    for keep_from, checkpoint in purges:
        assert checkpoint is not None, (
            f"batches before sequence {keep_from} were deleted while no checkpoint was committed: "
            "a restart now starts at step 0 and reads from sequence 1"
        )
        step, last = checkpoint
        assert keep_from <= first_seq(step - 1), (
            f"batches before sequence {keep_from} were deleted while the checkpoint in force was "
            f"step {step}'s (last sequence {last}): a restart reads from {last + 1}, a restarted "
            f"buffer needs step {step - 1} from sequence {first_seq(step - 1)}"
        )
    # A trim per checkpoint but the last (3, 6; not 8), each as far as its checkpoint allows.
    assert purges == [(first_seq(c - 1), (c, last_seq(c - 1))) for c in (3, 6)], purges
    assert left == steps_of(5, STEPS - 1), f"at the end the stream held (sequence, step) {left}"


@pytest.mark.timeout(120)
def test_a_resumed_trainer_starts_at_its_checkpoints_step_from_the_batch_after_it(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    """Trainer A trains KILL_AFTER steps in process and stops (its checkpoint holds
    CHECKPOINT_EVERY steps; the steps after it are lost with it). Trainer B, a new engine on
    the same checkpoint directory, must be at step CHECKPOINT_EVERY, read first the batch
    after the checkpoint's last sequence (nothing before it: no skip), and train that step
    to the loss A had for it."""
    model = build_tiny_model(tmp_path / "model", VOCAB, seed=0)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    run = f"resume-in-process-{uuid.uuid4().hex[:8]}"
    Result = tuple[int, int, tuple[list[BatchEvent], int] | None, list[int], dict, dict | None]

    async def scenario() -> Result:
        cfg = run_config(run, model, tmp_path / "checkpoints")
        rt = await attach_bootstrap(cfg, nats_server.url)
        await record(rt, range(KILL_AFTER), vocab)
        a, stop = Trainer(rt, 0), asyncio.Event()
        running = asyncio.create_task(a.run(stop))
        deadline = time.monotonic() + 90  # guards a hang only
        while a.engine.step < KILL_AFTER and not running.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        stop.set()
        await asyncio.wait_for(running, 30)
        await a.close()
        assert a.engine.step == KILL_AFTER, f"A trained {a.engine.step} of {KILL_AFTER} steps"

        b = Trainer(rt, 0)
        skipped: list[int] = []
        try:
            await b.setup()
            assert b.batches is not None
            refuse = b.batches.refuse

            async def watched_refuse(stored: readers.Stored[BatchEvent], reason: str) -> None:
                skipped.append(stored.seq)
                await refuse(stored, reason)

            b.batches.refuse = watched_refuse  # type: ignore[method-assign]
            step, resumed_from = b.engine.step, b.last_seq
            if step != CHECKPOINT_EVERY:  # collecting would only dead-letter every batch
                return step, resumed_from, None, skipped, {}, None
            give_up = asyncio.Event()
            asyncio.get_running_loop().call_later(30, give_up.set)  # guards a hang only
            collected = await b.collect(give_up)
            trained = await b.train(collected[0]) if collected else {}
        finally:
            await b.close()
        before = await metrics(rt, CHECKPOINT_EVERY)
        await rt.close()
        return step, resumed_from, collected, skipped, trained, before

    step, resumed_from, collected, skipped, trained, before = asyncio.run(scenario())
    assert step == CHECKPOINT_EVERY, (
        f"resumed from the checkpoint of step {CHECKPOINT_EVERY}, the trainer is at step {step}"
    )
    assert resumed_from == last_seq(CHECKPOINT_EVERY - 1), (
        f"the resumed trainer holds batches up to sequence {resumed_from}, its checkpoint up to "
        f"{last_seq(CHECKPOINT_EVERY - 1)}"
    )
    assert not skipped, (
        f"the resumed trainer read and skipped sequences {skipped} before its next step's batches"
    )
    assert collected is not None, f"the resumed trainer got no batch of step {CHECKPOINT_EVERY}"
    batches, last = collected
    assert [b.step for b in batches] == [CHECKPOINT_EVERY] * MICRO, [b.id for b in batches]
    assert last == last_seq(CHECKPOINT_EVERY), last
    assert before is not None and trained["step"] == before["step"] == CHECKPOINT_EVERY, (
        trained,
        before,
    )
    # The same model, optimizer and RNG as A had at that step, on the same batches.
    np.testing.assert_allclose(trained["loss"], before["loss"], rtol=1e-5, atol=1e-7)
