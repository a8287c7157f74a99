"""A whole group as one event (`schemas.group_events`): what it must hold, how it is stored when
it cannot be one event, and what the buffer does with one it refuses.

- A group event holds each sample of its prompt once, in sample order, under the id
  `<prompt id>/group`; anything else is refused on decode, with the reason.
- The streams of `trajectories` and `rewards` take either kind; a reader that asks for a
  sample's event refuses a group's.
- A group over the server's payload limit is stored sample by sample (the same ids a sample's
  own event has), on a real server; a sample too large alone is still refused.
- The buffer refuses a group event whole (to `dead`, with the reason) and records its prompt as
  dropped, so the gate replaces it; the next group trains.
"""

from __future__ import annotations

from pathlib import Path

import msgpack
import numpy as np
import pytest
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError
from pydantic import ValidationError

from bus.embedded import EmbeddedNats
from bus.publisher import EventTooLarge, Publisher
from bus.topology import TRAJECTORIES, Topology, drop_key
from consumers.group_publish import publish_group
from schemas import (
    DecodeError,
    Event,
    RewardGroupEvent,
    Tensor,
    Trajectories,
    TrajectoryEvent,
    TrajectoryGroupEvent,
    decode,
    encode,
    group_id,
)
from schemas.config import AlgorithmConfig, RunConfig
from schemas.kv_records import DropKind, DropRecord
from tests.buffer_feed import (
    SETTLE,
    batches,
    declare,
    drained,
    group,
    publish,
    run_with_js,
    start_buffer,
    stop_buffer,
    tail,
    until,
)
from tests.golden_events import GOLDEN, golden
from tests.helpers import dead_letters, stream_samples, trajectory


def trajectories(run: str, size: int, tokens: int = 8) -> list[TrajectoryEvent]:
    return [trajectory(run, 0, i, tokens=tokens, group=size) for i in range(size)]


def of(samples: list[TrajectoryEvent], change: dict | None = None) -> TrajectoryGroupEvent:
    """`samples` as a group's event, with the fields in `change` changed."""
    first = samples[0]
    fields: dict[str, object] = {
        "id": group_id(first.prompt_id),
        "run": first.run,
        "prompt_id": first.prompt_id,
        "samples": tuple(samples),
    }
    return TrajectoryGroupEvent.model_validate({**fields, **(change or {})})


def test_a_group_event_reads_as_its_samples_on_either_stream() -> None:
    samples = trajectories("r", 3)
    event = of(samples)
    back = decode(encode(event), Trajectories)
    assert back == event and back.each() == tuple(samples)
    assert decode(encode(samples[0]), Trajectories).each() == (samples[0],)
    with pytest.raises(
        DecodeError, match="expected jetrl.trajectory here, got jetrl.trajectory_gr"
    ):
        decode(encode(event), TrajectoryEvent)
    # Another event on a stream of either kind: refused by name, as any wrong type is.
    with pytest.raises(DecodeError, match="expected jetrl.trajectory or jetrl.trajectory_group"):
        decode(encode(golden()["prompt.v1"]), Trajectories)
    rewards: Event = decode((GOLDEN / "reward_group.v1.msgpack").read_bytes())
    assert isinstance(rewards, RewardGroupEvent)
    assert [r.id for r in rewards.each()] == ["g/0/3/0", "g/0/3/1"]
    assert rewards == golden()["reward_group.v1"]


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"samples": "first two"}, "2 samples for a group of 3"),
        ({"samples": "reversed"}, "sample 0 is 'r/0/0/2'"),
        ({"samples": "twice"}, "sample 2 is 'r/0/0/1'"),
        ({"id": "r/0/0/0"}, "must be 'r/0/0/group'"),
        ({"prompt_id": "r/0/1", "id": "r/0/1/group"}, "sample 0 is 'r/0/0/0'"),
        ({"run": "other"}, "a sample of another run"),
        ({"samples": "none"}, "at least one sample"),
    ],
)
def test_a_group_event_holds_each_sample_once_in_order(change: dict, reason: str) -> None:
    samples = trajectories("r", 3)
    arranged = {
        "first two": samples[:2],
        "reversed": samples[::-1],
        "twice": [samples[0], samples[1], samples[1]],
        "none": [],
    }
    if isinstance(change.get("samples"), str):
        change = {**change, "samples": tuple(arranged[change["samples"]])}
    with pytest.raises(ValidationError, match=reason):
        of(samples, change)
    # The same refusal reading it from the wire (the members as maps, checked there).
    fields = msgpack.unpackb(encode(of(samples)))
    wire = {**fields, **msgpack.unpackb(msgpack.packb(change, default=lambda m: m.__dict__))}
    with pytest.raises(DecodeError, match=reason):
        decode(msgpack.packb(wire), Trajectories)


def test_a_group_too_large_for_one_message_is_stored_sample_by_sample(
    nats_server: EmbeddedNats, topology: Topology
) -> None:
    samples = trajectories(topology.run, 4, tokens=64)
    event = of(samples)
    one, whole = len(encode(samples[0])), len(encode(event))

    async def body(js: JetStreamContext) -> None:
        await topology.apply(js)
        # Room for the whole group: one message.
        await publish_group(Publisher(js, topology, max_payload=whole + 4096), TRAJECTORIES, event)
        info = await js.stream_info(topology.stream(TRAJECTORIES))
        assert info.state.messages == 1
        # Room for a sample, not the group: a message per sample, with a sample's own id (the
        # re-publish of the group the first publish stored is a different id: both are kept).
        small = Publisher(js, topology, max_payload=one + 512)  # the headers' room
        assert whole > one + 512
        await publish_group(small, TRAJECTORIES, event)
        await publish_group(small, TRAJECTORIES, event)  # again: deduplicated by sample id
        stored = await stream_samples(js, topology, TRAJECTORIES)
        assert [t.id for t in stored] == [t.id for t in samples] * 2
        info = await js.stream_info(topology.stream(TRAJECTORIES))
        assert info.state.messages == 1 + len(samples)
        with pytest.raises(EventTooLarge):
            await publish_group(Publisher(js, topology, max_payload=one // 2), TRAJECTORIES, event)

    run_with_js(nats_server.url, body)


def test_the_buffer_refuses_a_group_event_whole_and_records_its_prompt_dropped(
    nats_server: EmbeddedNats, topology: Topology, tmp_path: Path
) -> None:
    """One sample of group 0 says weights v5 made it, which no run at step 0 can have: the
    group's event goes to `dead` whole, with the reason, and group 0 is recorded as dropped
    (refused); groups 1 and 2 form step 0."""
    bad = group(topology.run, 0, (0.0, 1.0))
    version = Tensor.from_numpy(np.full(8, 5, np.int32))
    t = bad[1].trajectory.model_copy(update={"versions": version})
    bad[1] = bad[1].model_copy(update={"trajectory": TrajectoryEvent.model_validate(dict(t))})
    good = group(topology.run, 1, (0.0, 1.0)) + group(topology.run, 2, (1.0, 0.0))
    log = tmp_path / "buffer.log"
    cfg = RunConfig(run=topology.run, algorithm=AlgorithmConfig(prompts_per_step=2))

    async def body(js: JetStreamContext) -> None:
        await declare(js, topology, cfg)
        await publish(js, topology, bad + good, grouped=True)
        proc = start_buffer(nats_server.url, topology, log)
        try:

            async def why() -> str:
                return f"the buffer did not settle:\n{tail(log)}"

            await until(lambda: drained(js, topology), SETTLE, why)
        finally:
            stop_buffer(proc)
        dead = await dead_letters(js, topology)
        assert len(dead) == 1, dead
        data, reason = dead[0]
        refused: Event = decode(data)
        assert isinstance(refused, RewardGroupEvent), refused
        assert [r.id for r in refused.each()] == [r.id for r in bad]
        assert "generated by weights v5" in reason, reason
        kv = await js.key_value(topology.kv_bucket)
        try:
            entry = await kv.get(drop_key(bad[0].trajectory.prompt_id))
        except KeyNotFoundError:
            raise AssertionError("the refused group's prompt was not recorded as dropped") from None
        record = DropRecord.decode(entry.value)
        assert record.kind is DropKind.REFUSED and "weights v5" in record.reason, record
        assert record.samples == 2
        stored = await batches(js, topology)
        assert {b.step for b in stored} == {0}
        assert set(stored[0].step_prompt_ids) == {f"{topology.run}/0/1", f"{topology.run}/0/2"}

    run_with_js(nats_server.url, body)
