"""A step whose publish fails part-way (the bus refusing writes for longer than the
publisher retries) is finished later from the same groups, and nothing is lost or twice.

The real buffer process, on a real nats-server. The batch stream is made to store the
first micro-batch of step 0 and refuse the rest (discard-new at one message), longer than
the buffer's publisher retries, so that forming the step fails with the step's groups
held; meanwhile two more complete groups arrive, which a buffer that forgot the step it
had begun could choose instead. Then the stream takes writes again, and:

- step 0 is whole and made of the groups its first (already stored) micro-batch names;
- no sample is in two batches, no group is both batched and dropped;
- every reward the buffer acked is inside a stored batch or has a drop record;
- the buffer's queue ends with nothing undelivered or unacked.

This is what a leader election of the batch stream does to a clustered run; it once made
a buffer form step 0 twice and ack three prompts' rewards that no stored batch held. The
test takes about 50 s: the buffer's publisher gives up on a refused micro-batch only after
its ack timeout and its retries (40 s with its defaults), and no less would show the bug.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import time
from pathlib import Path

import numpy as np
import pytest
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy

from bus.embedded import EmbeddedNats
from bus.publisher import Publisher
from bus.topology import BATCHES, Topology
from schemas import RewardEvent
from schemas.config import AlgorithmConfig, RunConfig, TrainerConfig
from tests.buffer_feed import (
    SETTLE,
    batches,
    buffer_consumer,
    by_step,
    check_steps,
    declare,
    drained,
    drop_record,
    group,
    publish,
    run_with_js,
    start_buffer,
    stop_buffer,
    summary,
    tail,
    until,
)

pytestmark = pytest.mark.slow  # a minute or more of real runs: -m 'not slow' skips it

PUBLISHER = inspect.signature(Publisher).parameters
GIVE_UP: float = PUBLISHER["ack_timeout"].default + PUBLISHER["retry_for"].default
"""When the buffer's publisher (the runtime's, with its defaults) gives up on a refused
micro-batch: the server's refusal of an async publish never reaches its future, so the
ack timeout runs out first, then the retries go on for `retry_for`."""
REFUSED_FOR = GIVE_UP + 5.0
"""Seconds the batch stream refuses writes once step 0's first micro-batch is stored: past
the publisher's give-up, with room for a busy machine."""
ACK_WAIT = 20.0
"""The buffer's work queue ack_wait: its heartbeat (every ack_wait / 3) retries an unsettled
step within seconds, and a retry begun just before the stream takes writes again (its first
publish then waits out the ack timeout) still ends before a held sample is redelivered."""
REWARDS = (0.0, 1.0, 1.0, 3.0)


def config(topology: Topology) -> RunConfig:
    # 64-token micro-batches and 45-token rows (5 prompt + 40 response): a step of 2 groups
    # of 4 is 8 micro-batches, so the stream can take the first and refuse the rest.
    return RunConfig(
        run=topology.run,
        algorithm=AlgorithmConfig(prompts_per_step=2),
        trainer=TrainerConfig(micro_batch_tokens=64),
    )


async def cap_messages(js: JetStreamContext, stream: str, max_msgs: int) -> None:
    """Make `stream` refuse new messages once it holds `max_msgs` (-1: no limit again), as a
    stream without a leader refuses them."""
    info = await js.stream_info(stream)
    discard = DiscardPolicy.NEW if max_msgs > 0 else DiscardPolicy.OLD
    await js.update_stream(dataclasses.replace(info.config, discard=discard, max_msgs=max_msgs))


def prompt_id(samples: list[RewardEvent]) -> str:
    return samples[0].trajectory.prompt_id


def test_a_step_whose_publish_fails_part_way_is_finished_from_the_same_groups(
    nats_server: EmbeddedNats, topology: Topology, tmp_path: Path
) -> None:
    first = [
        group(topology.run, i, np.roll(REWARDS, i).tolist(), response_tokens=40) for i in range(2)
    ]
    later = [
        group(topology.run, i, np.roll(REWARDS, i + 1).tolist(), response_tokens=40)
        for i in range(2, 4)
    ]
    groups = {prompt_id(g): [r.id for r in g] for g in first + later}
    url, log = nats_server.url, tmp_path / "buffer.log"

    async def body(js: JetStreamContext) -> None:
        stream = topology.stream(BATCHES)
        await declare(js, topology, config(topology), ack_wait=ACK_WAIT)
        await cap_messages(js, stream, 1)
        await publish(js, topology, [r for g in first for r in g])
        proc = start_buffer(url, topology, log)
        try:

            async def one_stored() -> bool:
                return (await js.stream_info(stream)).state.messages >= 1

            async def none_stored() -> str:
                return f"no micro-batch of step 0 stored within {SETTLE:.0f} s:\n{tail(log)}"

            await until(one_stored, SETTLE, none_stored)
            begun = await batches(js, topology)
            assert [(b.step, b.micro_count) for b in begun] == [(0, 8)], (
                f"expected 1 of 8 of step 0: {summary(begun)}"
            )
            chosen = begun[0].step_prompt_ids
            assert sorted(chosen) == sorted(prompt_id(g) for g in first), (
                f"step 0 begun with {chosen}"
            )

            await publish(js, topology, [r for g in later for r in g])
            deadline = time.monotonic() + REFUSED_FOR
            while time.monotonic() < deadline:
                held = (await js.stream_info(stream)).state.messages
                assert held == 1, f"the batch stream was to refuse writes, yet holds {held}"
                assert proc.poll() is None, (
                    f"the buffer died while the stream refused writes:\n{tail(log)}"
                )
                await asyncio.sleep(0.5)
            await cap_messages(js, stream, -1)

            # Not a failure yet: what the buffer stored and acked says more than a timeout.
            settle_by = time.monotonic() + SETTLE
            while not await drained(js, topology) and time.monotonic() < settle_by:
                await asyncio.sleep(0.2)
            info = await buffer_consumer(js, topology)  # as the running buffer left it
        finally:
            stop_buffer(proc)

        stored = await batches(js, topology)
        named = check_steps(stored, groups)
        assert 0 in named, f"step 0 was never completed: {summary(stored)}"
        assert named[0] == chosen, (
            f"step 0 was begun with groups {chosen} (its first micro-batch) but its other "
            "micro-batches were formed from "
            f"{sorted({b.step_prompt_ids for b in by_step(stored)[0]})}: {summary(stored)}"
        )
        batched = {p for step in named.values() for p in step}
        dropped = {p: r for p in groups if (r := await drop_record(js, topology, p)) is not None}
        assert not batched & dropped.keys(), (
            f"groups both batched and dropped: {sorted(batched & dropped.keys())}"
        )

        # Which rewards are unacked the server does not say, only how many: every reward neither
        # undelivered nor unacked was acked (or terminated: dropped, or dead-lettered, which
        # nothing here should be), so more acked than stored batches and drop records cover
        # means that some were lost.
        assert (
            info.num_pending is not None and info.num_ack_pending is not None
        )  # the server sends both
        acked = sum(map(len, groups.values())) - info.num_pending - info.num_ack_pending
        covered = {sid for b in stored for sid in b.sample_ids} | {
            sid for p in dropped for sid in groups[p]
        }
        uncovered = sorted(sid for sids in groups.values() for sid in sids if sid not in covered)
        assert acked <= len(covered), (
            f"the buffer acked {acked} rewards but only {len(covered)} are in a stored batch or a "
            f"dropped group: at least {acked - len(covered)} of {uncovered} were acked and lost; "
            f"batches: {summary(stored)}"
        )
        assert (info.num_pending, info.num_ack_pending) == (0, 0), (
            f"{SETTLE:.0f} s after the stream took writes again the buffer's queue still has "
            f"{info.num_pending} undelivered and {info.num_ack_pending} unacked rewards; batches: "
            f"{summary(stored)}; log:\n{tail(log)}"
        )
        assert sorted(named) == [0, 1] and not dropped, (
            f"expected steps 0 and 1 and nothing dropped: {summary(stored)}; dropped {dropped}"
        )
        assert proc.returncode == 0, f"buffer exit code {proc.returncode}:\n{tail(log)}"

    run_with_js(url, body)
