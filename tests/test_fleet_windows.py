"""Work-queue windows that hold a 1,000-worker fleet (issue 29, docs/scale.md).

Real nats-server. Two limits the scale model found below 1,000 rollout workers:
- `max_ack_pending` of `prompts` was fixed at 1,024: a run whose gate lets more prompts be in
  flight had its workers starved by the window, not by the gate. It is now raised to the gate's
  bound (`schemas.streams_config.window_needs`), and the buffer's window with it.
- `max_waiting` was fixed at 512: a fleet of more idle workers had the rest of its pull requests
  refused at once. It is now `streams.max_waiting` (default 4,096).
And one the scale bench hit at 1,000: nats-server 2.15 holds a stream that sets no consumer
limit to 1,000 consumers, and every rollout worker reads `weights` through its own. Every
stream and bucket of a run now sets `streams.max_consumers` (default 65,536).
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig
from nats.js.errors import BadRequestError

from bus.connection import connect
from bus.embedded import EmbeddedNats
from bus.membership import Membership, live_members
from bus.pull import Puller, PullRefused
from bus.topology import PROMPTS, REWARDS, WEIGHTS, Topology
from schemas.config import ConfigError, RunConfig, parse_config
from schemas.streams_config import window_needs

FLEET = 600
"""Idle rollout workers, each holding one pull request: more than the old fixed 512."""


def big_run(run: str, **streams: object) -> RunConfig:
    """A run whose gate lets 2 x 4,096 prompts (x 16 samples) be in flight (~1,000 workers'
    worth: docs/scale.md)."""
    return parse_config(
        {
            "run": run,
            "algorithm": {"prompts_per_step": 4096, "max_staleness": 1},
            "data": {"n": 16},
            "rollout": {"engine": "simulated"},
            "streams": streams,
        },
        "test",
    )


def test_the_windows_hold_what_the_gate_lets_be_in_flight(nats_server: EmbeddedNats) -> None:
    cfg = big_run("windows")
    in_flight = cfg.staleness.in_flight_prompts
    assert in_flight == 8192  # the gate's bound: (max_staleness + 1) x prompts_per_step
    topology = Topology.for_config(cfg)

    async def main() -> None:
        nc = await connect(nats_server.url, "test-windows")
        js = nc.jetstream()
        try:
            await topology.apply(js)
            prompts = await js.consumer_info(topology.stream(PROMPTS), "rollout")
            buffer = await js.consumer_info(topology.stream(REWARDS), "buffer")
        finally:
            await topology.delete(js)
            await nc.close()
        print(
            f"prompts window {prompts.config.max_ack_pending}, buffer window "
            f"{buffer.config.max_ack_pending}, max_waiting {prompts.config.max_waiting}"
        )
        # As the server has them: every prompt the gate admits fits in the rollout window,
        # every sample of them in the buffer's, with the safety factor (2) on top.
        assert prompts.config.max_ack_pending == 2 * in_flight
        assert buffer.config.max_ack_pending == 2 * in_flight * cfg.data.n
        assert prompts.config.max_waiting == cfg.streams.max_waiting == 4096

    asyncio.run(main())


def test_a_small_run_keeps_the_table_windows() -> None:
    """The channel table's windows are floors: a run that needs less keeps them."""
    cfg = parse_config({"run": "small", "rollout": {"engine": "simulated"}}, "test")
    assert window_needs(cfg)["prompts"] < PROMPTS.work_queue.max_ack_pending
    topology = Topology.for_config(cfg)
    assert topology.consumer_config(PROMPTS).max_ack_pending == 1024
    assert topology.consumer_config(REWARDS).max_ack_pending == 65536


def test_a_fleet_above_512_idle_workers_is_not_refused(nats_server: EmbeddedNats) -> None:
    """600 idle workers each hold a pull request on the empty prompts queue at once: none is
    refused ("409 Exceeded MaxWaiting" came back for 88 of them at the old 512)."""
    topology = Topology.for_config(big_run("waiting"))

    async def main() -> tuple[int, int]:
        nc = await connect(nats_server.url, "test-waiting")
        js = nc.jetstream()
        pullers = [Puller(js, topology.stream(PROMPTS), "rollout") for _ in range(FLEET)]
        try:
            await topology.apply(js)
            for puller in pullers:
                await puller.open()

            async def wait_for_work(puller: Puller) -> bool:
                """True when the server refused the request; the queue is empty, so an
                accepted one waits out its 3 s and returns nothing."""
                try:
                    assert await puller.fetch(1, 3.0) == []
                except PullRefused:
                    return True
                return False

            refused = await asyncio.gather(*(wait_for_work(p) for p in pullers))
            info = await js.consumer_info(topology.stream(PROMPTS), "rollout")
            return sum(refused), info.config.max_waiting or 0
        finally:
            for puller in pullers:
                await puller.close()
            await topology.delete(js)
            await nc.close()

    refused, max_waiting = asyncio.run(main())
    print(f"{refused} of {FLEET} waiting pull requests refused (max_waiting {max_waiting})")
    assert refused == 0, f"{refused} of {FLEET} idle workers refused at max_waiting {max_waiting}"


def test_max_waiting_is_validated() -> None:
    with pytest.raises(ConfigError, match="max_waiting"):
        big_run("bad", max_waiting=0)
    with pytest.raises(ConfigError, match="max_wait"):
        big_run("bad", max_wait=600)  # an unknown name is refused, not ignored


def test_one_process_holds_several_members(nats_server: EmbeddedNats) -> None:
    """`ops.bench.scale_workers` runs many workers in one process: each is its own entry in the
    members bucket (its own heartbeat), not one entry rewritten by all."""
    topology = Topology(run="several")

    async def main() -> list[str]:
        nc = await connect(nats_server.url, "test-several")
        js = nc.jetstream()
        try:
            await topology.apply(js)
            members = [
                await Membership.join(js, topology, "rollout", background=False, worker=f"w{i}")
                for i in range(3)
            ]
            members[1].report(weight_version=7)
            await members[1].put()
            return sorted(f"{m.role}:{m.weight_version}" for m in await live_members(js, topology))
        finally:
            await topology.delete(js)
            await nc.close()

    assert asyncio.run(main()) == ["rollout:7", "rollout:None", "rollout:None"]


READERS = 1_010
"""Consumers made on each stream: past the server's default limit of 1,000 a stream."""


def test_every_stream_and_bucket_holds_more_readers_than_the_servers_default(
    nats_server: EmbeddedNats,
) -> None:
    """`weights` (every rollout worker's reader), the members bucket (watchers) and the object
    store (each fetch's chunk reader) each take 1,010 consumers; a stream made without the
    limit refuses the 1,001st, so the server's default is what the run's limit lifts."""
    topology = Topology.for_config(big_run("consumers"))
    streams = {
        "weights": topology.stream(WEIGHTS),
        "members": f"KV_{topology.members_bucket}",
        "objects": f"OBJ_{topology.object_bucket}",
    }

    async def made(js: JetStreamContext, stream: str) -> int:
        """Consumers made on `stream` before the server refused one (READERS if none was)."""
        for count in range(READERS):
            config = ConsumerConfig(ack_policy=AckPolicy.NONE, inactive_threshold=60)
            try:
                await js.add_consumer(stream, config)
            except BadRequestError as exc:
                assert exc.description == "maximum consumers limit reached", exc
                return count
        return READERS

    async def main() -> dict[str, int]:
        nc = await connect(nats_server.url, "test-consumers")
        js = nc.jetstream()
        try:
            await topology.apply(js)
            counts = {name: await made(js, stream) for name, stream in streams.items()}
            bare = Topology(run="bareconsumers")
            await js.add_stream(
                dataclasses.replace(bare.stream_config(WEIGHTS), max_consumers=None)
            )
            counts["without the limit"] = await made(js, bare.stream(WEIGHTS))
            await js.delete_stream(bare.stream(WEIGHTS))
        finally:
            await topology.delete(js)
            await nc.close()
        return counts

    counts = asyncio.run(main())
    assert counts == {
        "weights": READERS,
        "members": READERS,
        "objects": READERS,
        "without the limit": 1_000,
    }, counts
