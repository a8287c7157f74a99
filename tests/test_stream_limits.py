"""Stream limits from the run's bounds, backpressure instead of loss, and the loss guard (issue 15).

Real nats-server: a small stream filled faster than its consumer drains it loses nothing and
its publisher waits; limits forced too low (an age limit) make the guard count the loss.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import nats.errors
import numpy as np
import pytest
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, PubAck, RetentionPolicy

from bus import loss
from bus.connection import connect
from bus.embedded import EmbeddedNats
from bus.publisher import Publisher
from bus.runtime import attach, publish_config
from bus.stage import Stage, serve
from bus.topology import BATCHES, DEAD, REWARDS, TRAJECTORIES, Topology
from bus.worker import WorkerOptions
from ops import status
from ops import streams as streams_cli
from ops.audit import audit
from schemas import Tensor, Trajectories, TrajectoryEvent, decode
from schemas.codec import encode
from schemas.config import ConfigError, RunConfig, parse_config
from schemas.streams_config import (
    BATCH_BYTES_PER_TOKEN,
    EVENT_OVERHEAD,
    MIN_STREAM_BYTES,
    PROMPT_BYTES_PER_TOKEN,
    TRAJECTORY_PROMPT_BYTES_PER_TOKEN,
    TRAJECTORY_RESPONSE_BYTES_PER_TOKEN,
    stream_needs,
)
from tests.helpers import trajectory
from tests.test_bus import run_bus

MIB = 1 << 20


def big_trajectory(run: str, index: int, text_bytes: int = 50_000) -> TrajectoryEvent:
    """A trajectory of about 50 KB: 20 of them fill a 1 MiB stream."""
    event = trajectory(run, prompt=index)
    return event.model_copy(update={"response_text": "x" * text_bytes})


def small_topology(**changes: object) -> Topology:
    """A run whose trajectories stream holds 1 MiB."""
    topology = Topology(run=f"t{uuid.uuid4().hex[:10]}")
    return Topology(
        run=topology.run,
        max_bytes={**topology.max_bytes, TRAJECTORIES.name: MIB},
        **changes,  # type: ignore[arg-type]
    )


def test_a_full_stream_makes_the_publisher_wait_and_loses_nothing(
    nats_server: EmbeddedNats, caplog: pytest.LogCaptureFixture
) -> None:
    """40 events of 50 KB into a 1 MiB stream whose consumer has not fetched: the stream stops
    at its limit, the publishes past it wait (none fails, none is dropped), and once the
    consumer acks, the rest go through; the consumer gets every one of the 40, in order."""
    topology = small_topology()
    count = 40

    async def body(js: JetStreamContext) -> None:
        # The in-flight budget is 12 events: publishes waiting for room keep theirs, so the
        # sender itself stops instead of piling retries onto the full stream.
        publisher = Publisher(
            js, topology, ack_timeout=1.0, retry_for=2.0, max_inflight_bytes=600_000
        )
        acks: list[asyncio.Future[PubAck]] = []

        async def send_all() -> None:
            for i in range(count):
                acks.append(await publisher.send(TRAJECTORIES, big_trajectory(topology.run, i)))

        sending = asyncio.create_task(send_all())
        # Until the stream has stopped growing for longer than retry_for (a full stream is not
        # a failure); polled, not one sleep: on a loaded machine filling it takes a while.
        stored, still = (await js.stream_info(topology.stream(TRAJECTORIES))).state, 0.0
        while still < 3.0:
            await asyncio.sleep(0.5)
            now = (await js.stream_info(topology.stream(TRAJECTORIES))).state
            still = still + 0.5 if now.messages == stored.messages and now.messages else 0.0
            stored = now
        assert stored.messages < count and stored.bytes <= MIB, (
            "the stream took more than its limit"
        )
        assert not any(a.done() and a.exception() for a in acks), (
            "a publish to the full stream failed"
        )
        assert all(not a.done() for a in acks[stored.messages :]), (
            "a publish past the limit did not wait"
        )
        assert not sending.done() and len(acks) < count, (
            "the sender did not wait for the in-flight budget"
        )
        assert any(
            "is full" in r.getMessage() and "backpressure" in r.getMessage() for r in caplog.records
        )

        sub = await js.pull_subscribe_bind(
            TRAJECTORIES.work_queue.durable, stream=topology.stream(TRAJECTORIES)
        )
        got: list[str] = []
        while len(got) < count:
            try:
                batch = await sub.fetch(5, timeout=5)
            except nats.errors.TimeoutError:
                pytest.fail(f"acking freed no room: {len(got)} of {count} events came")
            for msg in batch:
                got.append(decode(msg.data, TrajectoryEvent).id)
                await msg.ack_sync()
        assert got == [big_trajectory(topology.run, i).id for i in range(count)]
        await asyncio.wait_for(sending, 10.0)
        await asyncio.wait_for(asyncio.gather(*acks), 10.0)  # every publish went through
        assert await loss.lost(js, topology, TRAJECTORIES) == 0
        await publisher.close()

    with caplog.at_level(logging.WARNING, logger="jetrl.publisher"):
        run_bus(nats_server, topology, body)


def test_the_guard_counts_work_deleted_before_it_was_acked(nats_server: EmbeddedNats) -> None:
    """An age limit forced too low (1 s): 6 trajectories nobody fetched expire; the guard sees
    the stream's first sequence 6 past the ack floor, records it, and keeps the count after the
    consumer's floor moves on. Acked messages deleted are not counted."""
    topology = small_topology(max_age=1.0)

    async def body(js: JetStreamContext) -> None:
        publisher = Publisher(js, topology)
        sub = await js.pull_subscribe_bind(
            TRAJECTORIES.work_queue.durable, stream=topology.stream(TRAJECTORIES)
        )
        for i in range(2):  # consumed: deleted once acked, which is no loss
            await publisher.publish(TRAJECTORIES, trajectory(topology.run, prompt=i))
        for msg in await sub.fetch(2, timeout=5):
            await msg.ack_sync()
        assert await loss.lost(js, topology, TRAJECTORIES) == 0
        for i in range(2, 8):
            await publisher.publish(TRAJECTORIES, trajectory(topology.run, prompt=i))
        await asyncio.sleep(2.5)  # the server expires by age about once a second
        kv = await js.key_value(topology.kv_bucket)
        assert await loss.check(js, kv, topology, TRAJECTORIES) == 6
        assert await loss.recorded(kv, TRAJECTORIES) == 6
        # The next message is fetched: the floor jumps past the gap, the record keeps the count.
        await publisher.publish(TRAJECTORIES, trajectory(topology.run, prompt=9))
        for msg in await sub.fetch(1, timeout=5):
            await msg.ack_sync()
        assert await loss.lost(js, topology, TRAJECTORIES) == 0
        assert (await loss.all_lost(js, kv, topology))[TRAJECTORIES.name] == 6
        page = status.lost_line(await status._lost(js, topology))
        assert page.startswith("LOST WORK: trajectories 6 message(s)"), page
        audited = await audit(js, topology, RunConfig().staleness)
        assert audited["lost"] == {"prompts": 0, "trajectories": 6, "rewards": 0}
        await publisher.close()

    run_bus(nats_server, topology, body)


def test_streams_are_made_to_wait_not_to_drop(nats_server: EmbeddedNats) -> None:
    """What the server is told: discard new everywhere but dead; trajectories and rewards deleted
    once acked unless the config keeps them; the limits and age the config derives."""
    config = parse_config({"run": f"t{uuid.uuid4().hex[:10]}", "streams": {"max_age_s": 86400.0}})
    topology = Topology.for_config(config)
    needs = stream_needs(config)

    async def body(js: JetStreamContext) -> None:
        for channel in (TRAJECTORIES, REWARDS, BATCHES, DEAD):
            info = (await js.stream_info(topology.stream(channel))).config
            assert info.discard == (DiscardPolicy.OLD if channel is DEAD else DiscardPolicy.NEW)
            interest = channel in (TRAJECTORIES, REWARDS)
            assert info.retention == (
                RetentionPolicy.INTEREST if interest else RetentionPolicy.LIMITS
            )
            assert info.max_bytes == needs[channel.name].limit and info.max_age == 86400.0

    run_bus(nats_server, topology, body)
    kept = Topology.for_config(
        config.model_copy(
            update={"streams": config.streams.model_copy(update={"consumed": "keep"})}
        )
    )
    assert kept.stream_config(TRAJECTORIES).retention == RetentionPolicy.LIMITS


def test_needs_follow_the_gate_bound_and_an_override_below_is_refused() -> None:
    """The issue's large run: eta 4, 512 prompts x 16 samples, 16k-token responses."""
    large: dict[str, Any] = {
        "algorithm": {"max_staleness": 4, "prompts_per_step": 512},
        "data": {"n": 16, "sampling": {"max_tokens": 16384}},
        "streams": {"max_prompt_tokens": 1024, "safety_factor": 1.5},
    }
    needs = stream_needs(parse_config(large))
    per_sample = (
        EVENT_OVERHEAD
        + 1024 * TRAJECTORY_PROMPT_BYTES_PER_TOKEN
        + 16384 * TRAJECTORY_RESPONSE_BYTES_PER_TOKEN
    )
    assert needs["trajectories"].need == int(5 * 512 * 16 * per_sample * 1.5)
    assert needs["trajectories"].need > 4 << 30  # the old fixed 4 GiB would have dropped work
    assert (
        "(max_staleness 4 + 1) x prompts_per_step 512 x n 16 = 40960 samples"
        in needs["trajectories"].how
    )
    assert stream_needs(RunConfig())["weights"].need == MIN_STREAM_BYTES  # a tiny run: the floor
    with pytest.raises(
        ConfigError,
        match=r"streams.max_bytes.trajectories 1,000 is below the run's need of .* \(gate bound",
    ):
        parse_config({**large, "streams": {"max_bytes": {"trajectories": 1000}}})
    above = needs["trajectories"].need * 2
    limit = stream_needs(
        parse_config(
            {**large, "streams": {**large["streams"], "max_bytes": {"trajectories": above}}}
        )
    )
    assert limit["trajectories"].limit == above
    with pytest.raises(ConfigError, match="streams.max_bytes.trajectory"):
        parse_config({"streams": {"max_bytes": {"trajectory": 1 << 40}}})


def test_the_per_token_sizes_cover_the_codec() -> None:
    """The derivation's bytes per token are not below what the codec really writes."""
    prompt, response = 1000, 4000
    event = TrajectoryEvent(
        id="r/0/0/0",
        run="r",
        prompt_id="r/0/0",
        sample_index=0,
        group_size=2,
        prompt_ids=Tensor.from_numpy(np.zeros(prompt, dtype=np.int32)),
        response_ids=Tensor.from_numpy(np.zeros(response, dtype=np.int32)),
        logprobs=Tensor.from_numpy(np.full(response, -1.0, dtype=np.float32)),
        versions=Tensor.from_numpy(np.zeros(response, dtype=np.int32)),
        response_text="abcd" * response,
        task={"answer": "x" * 100},
    )
    derived = (
        EVENT_OVERHEAD
        + prompt * TRAJECTORY_PROMPT_BYTES_PER_TOKEN
        + response * TRAJECTORY_RESPONSE_BYTES_PER_TOKEN
    )
    assert len(encode(event)) <= derived


def test_a_stage_reports_work_its_stream_deleted_unacked(
    nats_server: EmbeddedNats, caplog: pytest.LogCaptureFixture
) -> None:
    """The loss guard runs beside every stage that serves a work queue: with an age limit forced
    to 1 s and a stage that takes one trajectory at a time, 3 s each, the 3 it has not fetched
    yet are deleted; the stage says so at ERROR and records the count in the run's KV, where
    ops.status and ops.audit read it. (The one it holds is deleted too, but the server moves
    the ack floor past a delivered message it deletes: the worker still has that one's data.)"""
    run = f"t{uuid.uuid4().hex[:10]}"
    config = parse_config({"run": run, "streams": {"max_age_s": 1.0, "guard_seconds": 0.3}})

    async def handler(event: Trajectories, msg: object) -> None:
        await asyncio.sleep(3.0)  # held past the age limit

    async def body() -> int:
        nc = await connect(nats_server.url, "test-declare")
        await Topology(run=run).apply_buckets(nc.jetstream())
        await publish_config(await nc.jetstream().key_value(Topology(run=run).kv_bucket), config)
        await nc.close()
        rt = await attach("reward", run, nats_server.url)
        try:
            for i in range(4):
                await rt.publisher.publish(TRAJECTORIES, trajectory(run, prompt=i))
            stop = asyncio.Event()
            stage = Stage(TRAJECTORIES, handler, WorkerOptions(concurrency=1))
            serving = asyncio.create_task(serve(rt, stage, stop))
            for _ in range(40):
                if await loss.recorded(rt.kv, TRAJECTORIES):
                    break
                await asyncio.sleep(0.25)
            stop.set()
            await asyncio.wait_for(serving, 20.0)
            return await loss.recorded(rt.kv, TRAJECTORIES)
        finally:
            await rt.close()

    with caplog.at_level(logging.ERROR, logger="jetrl.loss"):
        assert asyncio.run(body()) == 3, "the stage did not record the work its stream deleted"
    assert any(
        "WORK LOST" in r.getMessage() and "deleted 3 message(s)" in r.getMessage()
        for r in caplog.records
    )


def test_batches_are_bounded_by_the_checkpoint_interval_and_prompts_count_replacements() -> None:
    """Batches are trimmed at each checkpoint, so their need is the steps between two checkpoints
    plus the gate's steps ahead and the checkpoint's last step, not the run; the prompts need
    covers the replacements of dropped groups (`streams.max_dropped_share`). `ops.streams show`
    prints both derivations."""
    large: dict[str, Any] = {
        "algorithm": {"max_staleness": 4, "prompts_per_step": 512},
        "data": {"n": 16, "sampling": {"max_tokens": 16384}},
        "streams": {"max_prompt_tokens": 1024},
        "trainer": {"steps": 1000, "checkpoint_every": 10},
    }
    config = parse_config(large)
    needs = stream_needs(config)
    step = 512 * 16 * (1024 + 16384) * BATCH_BYTES_PER_TOKEN + EVENT_OVERHEAD
    assert config.staleness.batch_steps_kept == 10 + 4 + 2
    assert needs["batches"].need == int(16 * step * 2)  # 85 GiB, not the run's 5.2 TiB
    issued = 1000 * 512 * 2  # max_dropped_share 0.5: as many replacements as prompts trained
    assert needs["prompts"].need == int(
        issued * (EVENT_OVERHEAD + 1024 * PROMPT_BYTES_PER_TOKEN) * 2
    )
    fewer = parse_config({**large, "streams": {**large["streams"], "max_dropped_share": 0.0}})
    assert stream_needs(fewer)["prompts"].need * 2 == needs["prompts"].need
    # A short run holds no more steps than it has.
    short = parse_config({"trainer": {"steps": 5, "checkpoint_every": 10}})
    assert short.staleness.batch_steps_kept == 5
    shown = "\n".join(streams_cli.limits(config, "the test's config"))
    derived = (
        "min(checkpoint_every 10 + gate bound (max_staleness 4 + 1) + the checkpoint's last "
        "step 1, steps 1000)"
    )
    assert f"{derived} = 16 steps" in shown, shown
    assert "= 512000 trained / (1 - max_dropped_share 0.5) = 1024000 issued" in shown, shown
    with pytest.raises(ConfigError, match="max_dropped_share"):
        parse_config({"streams": {"max_dropped_share": 1.0}})
