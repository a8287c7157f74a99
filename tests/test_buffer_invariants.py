"""The buffer process keeps its invariants: what it publishes, when it acks, what it holds.

Each test runs `python -m consumers.buffer` against a real nats-server, feeds it scored
samples with known rewards and reads back the batch stream and the server's view of the
buffer's work queue:

- the advantages in the BatchEvents are the configured estimator's, sign and all;
- `algorithm.drop_equal_reward_groups` decides whether an all-equal group is dropped (with a
  KV record) or trained;
- killed after storing one micro-batch of a step, a restarted buffer completes that step from
  the same groups, although other complete groups reach it first (nothing acked early,
  nothing lost, nothing twice);
- killed after storing a whole step but before acking it, nothing is batched twice;
- samples it holds for longer than the queue's ack_wait are not redelivered.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
from nats.js import JetStreamContext

from bus.embedded import EmbeddedNats
from bus.topology import Topology
from schemas import BatchEvent, RewardEvent
from schemas.config import AlgorithmConfig, RunConfig, TrainerConfig
from tests.buffer_feed import (
    SETTLE,
    batches,
    buffer_consumer,
    check_steps,
    declare,
    drained,
    drop_record,
    expected_advantages,
    group,
    publish,
    run_with_js,
    start_buffer,
    stop_buffer,
    summary,
    tail,
    until,
)

# The work queue's ack_wait in the tests that kill a buffer or hold samples: samples a
# killed buffer held come back after it, and a held sample must outlive it several times.
ACK_WAIT = 2.0
# The ack_wait when a restarted buffer must see new samples before the killed one's return.
ORPHAN_WAIT = 20.0
REWARDS_A = (0.0, 1.0, 1.0, 3.0)
REWARDS_B = (2.0, 0.0, 0.0, 0.5)


def config(topology: Topology, **algorithm: object) -> RunConfig:
    # 64-token micro-batches: a 45-token row (5 prompt + 40 response, as the kill tests feed)
    # fills one, so a step of 2 groups of 4 is 8 micro-batches and a kill can fall between them.
    return RunConfig(
        run=topology.run,
        algorithm=AlgorithmConfig(prompts_per_step=2, **algorithm),
        trainer=TrainerConfig(micro_batch_tokens=64),
    )


async def settled(
    js: JetStreamContext, topology: Topology, proc: subprocess.Popen[bytes], log: Path, what: str
) -> None:
    """Wait until the buffer has acked every reward; fail saying what is left if it does not."""

    async def state() -> str:
        info = await buffer_consumer(js, topology)
        return (
            f"{what}: after {SETTLE:.0f} s the buffer's queue still has {info.num_pending} "
            f"undelivered and {info.num_ack_pending} unacked rewards; batches: "
            f"{summary(await batches(js, topology))}; buffer exit code {proc.poll()}; "
            f"log:\n{tail(log)}"
        )

    await until(lambda: drained(js, topology), SETTLE, state)


def advantages_by_sample(stored: list[BatchEvent]) -> dict[str, tuple[float, float]]:
    """sample id -> (advantage, reward) as the batches carry them."""
    out: dict[str, tuple[float, float]] = {}
    for batch in stored:
        for sid, adv, rew in zip(
            batch.sample_ids, batch.advantages.numpy(), batch.rewards.numpy(), strict=True
        ):
            out[sid] = (float(adv), float(rew))
    return out


def ids(rewards: list[RewardEvent]) -> list[str]:
    return [r.id for r in rewards]


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "gae"])
def test_batched_advantages_are_the_configured_estimators(
    nats_server: EmbeddedNats, topology: Topology, tmp_path: Path, estimator: str
) -> None:
    a, b = group(topology.run, 0, REWARDS_A), group(topology.run, 1, REWARDS_B)
    log = tmp_path / "buffer.log"

    async def body(js: JetStreamContext) -> None:
        await declare(js, topology, config(topology, advantage=estimator))
        await publish(js, topology, a + b)
        proc = start_buffer(nats_server.url, topology, log)
        try:
            await settled(js, topology, proc, log, "step 0 of groups A and B")
        finally:
            stop_buffer(proc)
        assert proc.returncode == 0, f"buffer exit code {proc.returncode}:\n{tail(log)}"
        stored = await batches(js, topology)
        named = check_steps(
            stored, {a[0].trajectory.prompt_id: ids(a), b[0].trajectory.prompt_id: ids(b)}
        )
        assert list(named) == [0], summary(stored)
        got = advantages_by_sample(stored)
        for samples, rewards in ((a, REWARDS_A), (b, REWARDS_B)):
            want = expected_advantages(estimator, rewards)
            have = np.array([got[r.id][0] for r in samples])
            assert np.allclose(have, want, rtol=1e-5, atol=1e-5), (
                f"{estimator}: rewards {rewards} were batched with advantages {have.tolist()}, "
                f"expected {want.tolist()}"
            )
            assert [got[r.id][1] for r in samples] == list(rewards), (
                "the batch carries other rewards than were scored"
            )

    run_with_js(nats_server.url, body)


@pytest.mark.parametrize("drop_equal", [True, False])
def test_drop_equal_reward_groups_reaches_the_buffer(
    nats_server: EmbeddedNats, topology: Topology, tmp_path: Path, drop_equal: bool
) -> None:
    equal = group(topology.run, 0, (1.0, 1.0, 1.0, 1.0))
    a, b = group(topology.run, 1, REWARDS_A), group(topology.run, 2, REWARDS_B)
    fed = equal + a + (b if drop_equal else [])  # two trainable groups make a step either way
    equal_id = equal[0].trajectory.prompt_id
    log = tmp_path / "buffer.log"

    async def body(js: JetStreamContext) -> None:
        await declare(js, topology, config(topology, drop_equal_reward_groups=drop_equal))
        await publish(js, topology, fed)
        proc = start_buffer(nats_server.url, topology, log)
        try:
            await settled(js, topology, proc, log, f"drop_equal_reward_groups={drop_equal}")
        finally:
            stop_buffer(proc)
        assert proc.returncode == 0, f"buffer exit code {proc.returncode}:\n{tail(log)}"
        stored = await batches(js, topology)
        groups = {g[0].trajectory.prompt_id: ids(g) for g in (equal, a, b)}
        named = check_steps(stored, groups)
        record = await drop_record(js, topology, equal_id)
        if drop_equal:
            assert named == {0: (a[0].trajectory.prompt_id, b[0].trajectory.prompt_id)}, (
                "with drop_equal_reward_groups the all-equal group must not be trained: "
                f"{summary(stored)}"
            )
            assert record is not None and "equal" in record, (
                f"no drop record for the all-equal group: {record!r}"
            )
        else:
            assert named == {0: (equal_id, a[0].trajectory.prompt_id)}, (
                "without drop_equal_reward_groups the all-equal group must be trained: "
                f"{summary(stored)}"
            )
            assert record is None, f"the all-equal group was recorded as dropped: {record!r}"
            got = advantages_by_sample(stored)
            assert [got[r.id][0] for r in equal] == [0.0] * 4, (
                "equal rewards must give zero advantages"
            )

    run_with_js(nats_server.url, body)


def kill_then_restart(
    url: str, topology: Topology, tmp_path: Path, point: str, ack_wait: float, grouped: bool
) -> None:
    """Four groups (two steps) fed to a buffer armed to die at `point` on step 0; then two more
    groups, and a second buffer without the crash point. It gets the two new groups at once
    (the first buffer's samples come back only once `ack_wait` has run out), and must still
    store step 0 whole from the groups the first one chose, then the rest, each sample once.
    `grouped`: each group travels as one event (`schemas.group_events`), else a sample each."""
    fed = [
        group(topology.run, i, np.roll(REWARDS_A, i).tolist(), response_tokens=40) for i in range(4)
    ]
    fresh = [
        group(topology.run, i, np.roll(REWARDS_B, i).tolist(), response_tokens=40)
        for i in range(4, 6)
    ]
    groups = {g[0].trajectory.prompt_id: ids(g) for g in fed + fresh}
    log = tmp_path / "buffer.log"

    async def body(js: JetStreamContext) -> None:
        # Every sample is made by v0; a wide staleness bound keeps step 2 from dropping any.
        await declare(js, topology, config(topology, max_staleness=10), ack_wait=ack_wait)
        await publish(js, topology, [r for g in fed for r in g], grouped)
        first = start_buffer(url, topology, log, crash_at=f"{point}@1")
        try:
            await asyncio.to_thread(first.wait, SETTLE)
        except subprocess.TimeoutExpired:
            first.kill()
            died = f"the buffer armed at {point} did not die within {SETTLE:.0f} s"
            raise AssertionError(f"{died}:\n{tail(log)}") from None
        assert first.returncode == -signal.SIGKILL, (
            f"buffer exit code {first.returncode}, not SIGKILL:\n{tail(log)}"
        )
        assert f"crash point {point}" in tail(log), tail(log)
        before = await batches(js, topology)
        assert before, f"the buffer died at {point} with nothing stored"
        chosen = before[0].step_prompt_ids
        assert len(chosen) == 2 and {b.step for b in before} == {0}, summary(before)

        await publish(js, topology, [r for g in fresh for r in g], grouped)
        second = start_buffer(url, topology, log)
        try:
            await settled(js, topology, second, log, f"restarted after a kill at {point}")
        finally:
            stop_buffer(second)
        assert second.returncode == 0, f"buffer exit code {second.returncode}:\n{tail(log)}"
        stored = await batches(js, topology)
        named = check_steps(stored, groups)
        assert named[0] == chosen, f"step 0 was begun with groups {chosen} but holds {named[0]}"
        assert sorted(named) == [0, 1, 2], f"expected steps 0, 1 and 2: {summary(stored)}"
        batched = sorted(sid for b in stored for sid in b.sample_ids)
        assert batched == sorted(sid for g in groups.values() for sid in g), "a sample was lost"
        info = await buffer_consumer(js, topology)
        assert (info.num_pending, info.num_ack_pending) == (0, 0), (
            "rewards left unacked after all steps"
        )
        dropped = {p: r for p in groups if (r := await drop_record(js, topology, p)) is not None}
        assert not dropped, f"groups dropped: {dropped}"

    run_with_js(url, body)


@pytest.mark.parametrize("grouped", [False, True], ids=["per-sample", "group-events"])
def test_a_step_stored_in_part_is_completed_from_the_same_groups_after_a_kill(
    nats_server: EmbeddedNats, topology: Topology, tmp_path: Path, grouped: bool
) -> None:
    """Killed after the first of step 0's micro-batches is stored: its samples must still be
    unacked (redelivered), and the restarted buffer must re-form step 0 from the groups that
    micro-batch names, although other complete groups reach it first: not a step 1 instead,
    nor a step 0 of other groups. The long ack_wait keeps the first buffer's samples away
    until the new groups are in (a restart takes seconds)."""
    kill_then_restart(nats_server.url, topology, tmp_path, "buffer.mid_step", ORPHAN_WAIT, grouped)


@pytest.mark.parametrize("grouped", [False, True], ids=["per-sample", "group-events"])
def test_a_step_stored_but_not_acked_is_not_batched_again_after_a_kill(
    nats_server: EmbeddedNats, topology: Topology, tmp_path: Path, grouped: bool
) -> None:
    """Killed with step 0 wholly stored and none of its samples acked: the redelivered samples
    are acked as batched already, and the later steps are made of the other groups."""
    kill_then_restart(nats_server.url, topology, tmp_path, "buffer.step_stored", ACK_WAIT, grouped)


def test_held_samples_are_not_redelivered_while_the_buffer_holds_them(
    nats_server: EmbeddedNats, topology: Topology, tmp_path: Path
) -> None:
    """A complete group waiting for a second one, and three samples of an incomplete one, are
    held unacked for over 3x the queue's ack_wait: the buffer's heartbeat must keep every one
    of them from being redelivered; once the group completes, the step is formed and acked."""
    a, b = group(topology.run, 0, REWARDS_A), group(topology.run, 1, REWARDS_B)
    held = a + b[:3]
    url, log = nats_server.url, tmp_path / "buffer.log"

    async def body(js: JetStreamContext) -> None:
        await declare(js, topology, config(topology), ack_wait=ACK_WAIT)
        await publish(js, topology, held)
        proc = start_buffer(url, topology, log)
        try:

            async def holding() -> bool:
                return (await buffer_consumer(js, topology)).num_ack_pending == len(held)

            async def not_holding() -> str:
                info = await buffer_consumer(js, topology)
                return (
                    f"the buffer never held all {len(held)} samples: "
                    f"{info.num_ack_pending} unacked:\n{tail(log)}"
                )

            await until(holding, SETTLE, not_holding)
            await asyncio.sleep(3.5 * ACK_WAIT)
            info = await buffer_consumer(js, topology)
            assert proc.poll() is None, f"the buffer died while holding:\n{tail(log)}"
            assert info.num_redelivered == 0, (
                f"{info.num_redelivered} held samples were redelivered after "
                f"{3.5 * ACK_WAIT:.0f} s (ack_wait {ACK_WAIT:.0f} s): "
                "the buffer did not keep them in progress"
            )
            assert info.delivered is not None  # the server sends it
            assert info.delivered.consumer_seq == len(held), (
                f"{info.delivered.consumer_seq} deliveries for {len(held)} samples: "
                "some were delivered twice"
            )
            assert info.num_ack_pending == len(held), (
                f"{info.num_ack_pending} held, not {len(held)}"
            )
            assert await batches(js, topology) == [], "a step was formed from an incomplete group"

            await publish(js, topology, b[3:])
            await settled(js, topology, proc, log, "step 0 once the held group completed")
        finally:
            stop_buffer(proc)
        assert proc.returncode == 0, f"buffer exit code {proc.returncode}:\n{tail(log)}"
        check_steps(
            await batches(js, topology),
            {a[0].trajectory.prompt_id: ids(a), b[0].trajectory.prompt_id: ids(b)},
        )

    run_with_js(url, body)
