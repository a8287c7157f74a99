"""The readers of each read mode (bus.readers) against a real nats-server.

- Each yields the channel's events decoded, with their stream sequences, in its mode's order:
  BROADCAST the last stored then each new one, BY_POSITION from a sequence on, REPLAY the
  stream once up to where it ended when opened, LAST_STORED by sequence from the end back.
- Poison is handled one way by all: skipped, and dead-lettered (original bytes, reason, under
  the reader's role) when the reader has a publisher, only logged when it has none; an event
  the caller refuses goes the same way.
- Closing a reader unsubscribes: its consumer has no subscriber left.
- Outside bus/, no code calls nats-py to subscribe, open a consumer or get a stored message
  (an explicit allow-list, empty for the main job).
"""

from __future__ import annotations

import ast
import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path

import nats.errors
import pytest
from nats.js import JetStreamContext

from bus.connection import connect
from bus.dead import REASON, SEQUENCE, STAGE
from bus.embedded import EmbeddedNats
from bus.publisher import Publisher
from bus.readers import Broadcast, ByPosition, LastStored, Poison, Replay, Stored
from bus.topology import DEAD, PROMPTS, Topology
from schemas import PromptEvent, encode
from tests.helpers import messages, prompt

ROOT = Path(__file__).resolve().parent.parent
POISON = b"\x93not an event"


def run(
    nats_server: EmbeddedNats, topology: Topology, body: Callable[..., Awaitable[None]]
) -> None:
    async def main() -> None:
        nc = await connect(nats_server.url, "test-readers")
        js = nc.jetstream()
        await topology.apply(js)
        try:
            await body(js, Publisher(js, topology))
        finally:
            await nc.drain()

    asyncio.run(main())


async def put(js: JetStreamContext, topology: Topology, *indices: int | None) -> None:
    """A prompt per index, in order; None stores poison there."""
    for index in indices:
        data = POISON if index is None else encode(prompt(topology.run, index))
        await js.publish(topology.subject(PROMPTS), data)


async def dead(js: JetStreamContext, topology: Topology) -> list[tuple[str, str, bytes, str]]:
    """(stage, original sequence, bytes, reason) of every dead letter."""
    reader = LastStored(js, topology, DEAD, Poison("test"))
    out = []
    first, last = await reader.bounds()
    for seq in range(first or 1, last + 1):
        raw = await js.get_msg(topology.stream(DEAD), seq)
        headers = raw.headers or {}
        out.append((headers[STAGE], headers[SEQUENCE], raw.data or b"", headers[REASON]))
    return out


async def consumers(js: JetStreamContext, topology: Topology) -> int:
    """Push consumers on the prompt stream that a subscriber still reads (an ordered consumer
    outlives its subscription on the server until its inactivity threshold)."""
    await asyncio.sleep(0.2)  # the server sees interest change a moment later
    return sum(bool(c.push_bound) for c in await js.consumers_info(topology.stream(PROMPTS)))


def indices(stored: list[Stored[PromptEvent]]) -> list[tuple[int, int]]:
    return [(s.seq, s.event.index) for s in stored]


def test_broadcast_gives_the_last_stored_then_each_new_one_and_closes_its_consumer(
    nats_server: EmbeddedNats, topology: Topology
) -> None:
    async def body(js: JetStreamContext, publisher: Publisher) -> None:
        base = await consumers(js, topology)
        await put(js, topology, 0, 1)
        async with Broadcast(js, topology, PROMPTS, Poison("producer")) as reader:
            first = await reader.next(timeout=5)
            await put(js, topology, 2, None, 3)
            later = [await reader.next(timeout=5), await reader.next(timeout=5)]
            with pytest.raises(nats.errors.TimeoutError):
                await reader.next(timeout=0.3)
            assert await consumers(js, topology) == base + 1
        assert indices([first, *later]) == [(2, 1), (3, 2), (5, 3)]
        assert await consumers(js, topology) == base

    run(nats_server, topology, body)


def test_by_position_reads_from_a_sequence_on_in_order(
    nats_server: EmbeddedNats, topology: Topology
) -> None:
    async def body(js: JetStreamContext, publisher: Publisher) -> None:
        base = await consumers(js, topology)
        await put(js, topology, 0, 1, 2, 3)
        reader: ByPosition[PromptEvent] = ByPosition(
            js, topology, PROMPTS, Poison("trainer"), start_seq=3
        )
        async with reader:
            got = [await reader.next(timeout=5)]
            await put(js, topology, 4)
            got += [await reader.next(timeout=5), await reader.next(timeout=5)]
        assert indices(got) == [(3, 2), (4, 3), (5, 4)]
        assert await consumers(js, topology) == base

    run(nats_server, topology, body)


def test_replay_reads_the_stream_once_up_to_its_end_when_opened(
    nats_server: EmbeddedNats, topology: Topology
) -> None:
    async def body(js: JetStreamContext, publisher: Publisher) -> None:
        base = await consumers(js, topology)
        async with Replay(js, topology, PROMPTS, Poison("buffer")) as empty:
            assert [s async for s in empty] == []
        await put(js, topology, 0, 1, 2, None)  # the last one poison: the replay still ends
        await js.delete_msg(topology.stream(PROMPTS), 1)  # a trimmed start
        got: list[Stored[PromptEvent]] = []
        async with Replay(js, topology, PROMPTS, Poison("buffer")) as reader:
            async for stored in reader:
                got.append(stored)
                if len(got) == 1:
                    await put(js, topology, 9)  # after it opened: not in the replay
        assert indices(got) == [(2, 1), (3, 2)]
        assert await consumers(js, topology) == base
        # The stream's last message deleted: the replay ends where nothing more is pending,
        # rather than wait for that sequence.
        await js.delete_msg(topology.stream(PROMPTS), 5)
        async with Replay(js, topology, PROMPTS, Poison("buffer"), timeout=1) as reader:
            try:
                ended: list[Stored[PromptEvent]] | None = [s async for s in reader]
            except TimeoutError:
                ended = None
        assert ended is not None and indices(ended) == [(2, 1), (3, 2)]

    run(nats_server, topology, body)


def test_last_stored_reads_back_from_the_end_stepping_over_deleted_and_poison(
    nats_server: EmbeddedNats, topology: Topology
) -> None:
    async def body(js: JetStreamContext, publisher: Publisher) -> None:
        reader = LastStored(js, topology, PROMPTS, Poison("producer"), patient=True)
        assert await reader.last() is None
        assert await reader.last_seq() == 0
        assert [s async for s in reader.back()] == []
        await put(js, topology, 0, 1, 2, 3, None)
        await js.delete_msg(topology.stream(PROMPTS), 3)
        assert await reader.last() is None  # the last is poison
        assert await reader.last_seq() == 5  # whatever it holds
        assert await reader.at(3) is None  # deleted
        assert indices([s async for s in reader.back()]) == [(4, 3), (2, 1), (1, 0)]
        assert indices([s async for s in reader.back(start=4, limit=2)]) == [(4, 3)]
        await put(js, topology, 7)
        last = await reader.last()
        assert last is not None and (last.seq, last.event.index) == (6, 7)
        assert await dead(js, topology) == []  # no publisher: logged only

    run(nats_server, topology, body)


def test_every_mode_dead_letters_poison_once_under_its_role_and_refused_events_likewise(
    nats_server: EmbeddedNats, topology: Topology
) -> None:
    async def body(js: JetStreamContext, publisher: Publisher) -> None:
        await put(js, topology, 0, None, 1)
        replay: Replay[PromptEvent] = Replay(js, topology, PROMPTS, Poison("buffer", publisher))
        async with replay:
            assert indices([s async for s in replay]) == [(1, 0), (3, 1)]
        by_position: ByPosition[PromptEvent] = ByPosition(
            js, topology, PROMPTS, Poison("trainer", publisher), start_seq=1
        )
        async with by_position:
            first = await by_position.next(timeout=5)
            assert indices([first, await by_position.next(timeout=5)]) == [(1, 0), (3, 1)]
            await by_position.refuse(first, "too long for the model")
        async with Broadcast(js, topology, PROMPTS, Poison("rollout", publisher)) as broadcast:
            await put(js, topology, None, 2)
            # The last stored (index 1) first, then the poison is stepped over.
            assert indices([await broadcast.next(timeout=5), await broadcast.next(timeout=5)]) == [
                (3, 1),
                (5, 2),
            ]
        last = LastStored(js, topology, PROMPTS, Poison("reward", publisher))
        assert indices([s async for s in last.back()]) == [(5, 2), (3, 1), (1, 0)]
        stored_first = (await js.get_msg(topology.stream(PROMPTS), 1)).data
        letters = sorted(await dead(js, topology))
        assert [(stage, seq, data) for stage, seq, data, _ in letters] == [
            ("buffer", "2", POISON),
            ("reward", "2", POISON),
            ("reward", "4", POISON),
            ("rollout", "4", POISON),
            ("trainer", "1", stored_first),
            ("trainer", "2", POISON),
        ]
        reasons = {(stage, seq): reason for stage, seq, _, reason in letters}
        assert reasons[("trainer", "1")] == "too long for the model"
        assert reasons[("buffer", "2")].startswith("not msgpack")
        assert await messages(js, topology, DEAD) == len(letters)

    run(nats_server, topology, body)


RAW_READS = {
    "subscribe",
    "pull_subscribe",
    "pull_subscribe_bind",
    "consumer_info",
    "get_msg",
    "get_last_msg",
}
"""nats-py calls that open a subscription or consumer or read a stored message: bus/ only."""
ALLOWED: dict[str, set[str]] = {
    # The main job: none.
    # Operator tools, where the raw client call is what a benchmark measures.
    "ops/bench/bus.py": {"pull_subscribe_bind"},
    "ops/bench/weights.py": {"subscribe"},
    # The time each weight announcement left the server, what every worker's reach is
    # measured from (a core subscription: no consumer, nothing a stage reads).
    "ops/bench/scale_probe.py": {"subscribe"},
}
PACKAGES = ("producers", "consumers", "engines", "schemas", "ops")
"""Every package but bus/ (tests/ and examples/ are not the product)."""


def raw_reads(path: Path) -> set[str]:
    """The RAW_READS methods `path` calls (as `x.name(...)`), comments and docstrings aside."""
    tree = ast.parse(path.read_text(), str(path))
    return {
        node.func.attr
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in RAW_READS
    }


def test_outside_bus_nothing_opens_a_subscription_consumer_or_get_msg_of_its_own() -> None:
    found = {
        path.relative_to(ROOT).as_posix(): calls
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        if (calls := raw_reads(path))
    }
    assert found == ALLOWED, "read through bus.readers (or bus.worker, bus.lag) instead"
