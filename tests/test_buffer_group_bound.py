"""A group that can never complete is not held for ever: `algorithm.max_group_wait_steps`.

A well-formed sample of a prompt that was never issued (or whose other samples are lost) would
be held unacked by the buffer for good. Past the bound, counted in steps the buffer formed
since the group's first sample came, the group is dropped: a `drop.<prompt id>` KV record
(so the producer's gate issues a replacement), its samples dead-lettered with the reason and
terminated. A group that is only slow, and completes within the bound, is still trained.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from nats.js import JetStreamContext

from bus.embedded import EmbeddedNats
from bus.topology import Topology
from schemas import RewardEvent, decode
from schemas.config import (
    AlgorithmConfig,
    ConfigError,
    RunConfig,
    TrainerConfig,
    parse_config,
)
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
    scored,
    start_buffer,
    stop_buffer,
    summary,
    tail,
    until,
)
from tests.helpers import dead_letters

WAIT_STEPS = 2


def config(topology: Topology) -> RunConfig:
    # One group a step, so each complete group fed makes one step. Every sample is made by
    # weights v0: the wide staleness bound keeps step 2 from dropping any as stale.
    return RunConfig(
        run=topology.run,
        algorithm=AlgorithmConfig(
            prompts_per_step=1, max_staleness=10, max_group_wait_steps=WAIT_STEPS
        ),
        trainer=TrainerConfig(micro_batch_tokens=64),
    )


def test_an_incomplete_group_is_dropped_once_max_group_wait_steps_steps_have_formed(
    nats_server: EmbeddedNats, topology: Topology, tmp_path: Path
) -> None:
    """Held from step 0: an orphan (1 sample of a group of 2, never to complete) and a slow
    group (3 of 4). Two complete groups make steps 0 and 1: both are still held (2 steps is
    not more than the bound). The slow group's last sample makes step 2 of it; the orphan,
    now 3 steps old, is dropped with a KV record, dead-lettered with the same reason, and
    nothing of it is left pending or unacked on the buffer's queue; its other sample, coming
    after the drop, is rejected to `dead` rather than held as a new group."""
    run = topology.run
    orphan, late = (scored(run, f"{run}/9/0", i, 1.0, group=2) for i in (0, 1))
    slow = group(run, 0, (0.0, 1.0, 2.0, 3.0))
    fillers = [group(run, i, (float(i), 0.0, 1.0, 0.5)) for i in (1, 2)]
    orphan_id, slow_id = orphan.trajectory.prompt_id, slow[0].trajectory.prompt_id
    log = tmp_path / "buffer.log"

    async def body(js: JetStreamContext) -> None:
        await declare(js, topology, config(topology))
        await publish(js, topology, [orphan, *slow[:3]])
        proc = start_buffer(nats_server.url, topology, log)
        try:

            async def held(count: int) -> bool:
                return (await buffer_consumer(js, topology)).num_ack_pending == count

            async def state(what: str) -> str:
                info = await buffer_consumer(js, topology)
                return (
                    f"{what}: {info.num_pending} undelivered and {info.num_ack_pending} unacked "
                    f"rewards; batches: {summary(await batches(js, topology))}; drop record of the "
                    f"orphan: {await drop_record(js, topology, orphan_id)!r}; buffer exit code "
                    f"{proc.poll()}; log:\n{tail(log)}"
                )

            await until(
                lambda: held(4),
                SETTLE,
                lambda: state("the buffer never held the orphan and the slow group"),
            )
            await publish(js, topology, [r for g in fillers for r in g])

            async def two_steps() -> bool:
                return sorted(by_step(await batches(js, topology))) == [0, 1] and await held(4)

            await until(
                two_steps, SETTLE, lambda: state("steps 0 and 1 of the two complete groups")
            )
            assert await drop_record(js, topology, orphan_id) is None, (
                f"the orphan was dropped after {WAIT_STEPS} steps, not more: "
                f"{await state('too eager')}"
            )

            await publish(js, topology, slow[3:])

            async def settled() -> bool:
                return (
                    await drained(js, topology)
                    and await drop_record(js, topology, orphan_id) is not None
                )

            await until(
                settled, SETTLE, lambda: state(f"the orphan dropped after {WAIT_STEPS + 1} steps")
            )
            # The orphan's other sample, late: rejected at once, not held as a new group.
            await publish(js, topology, [late])
            await until(
                lambda: drained(js, topology),
                SETTLE,
                lambda: state("the late sample of the dropped orphan"),
            )
        finally:
            stop_buffer(proc)
        assert proc.returncode == 0, f"buffer exit code {proc.returncode}:\n{tail(log)}"

        stored = await batches(js, topology)
        named = check_steps(
            stored, {g[0].trajectory.prompt_id: [r.id for r in g] for g in (slow, *fillers)}
        )
        assert named == {
            0: (fillers[0][0].trajectory.prompt_id,),
            1: (fillers[1][0].trajectory.prompt_id,),
            2: (slow_id,),
        }, f"the slow group, complete within the bound, must be step 2: {summary(stored)}"
        assert await drop_record(js, topology, slow_id) is None, "the slow group was dropped"

        reason = await drop_record(js, topology, orphan_id)
        assert reason is not None and "max_group_wait_steps" in reason and "1 of 2" in reason, (
            f"the orphan's drop record does not say why: {reason!r}"
        )
        dead = [
            (decode(data, RewardEvent).id, why) for data, why in await dead_letters(js, topology)
        ]
        assert dead == [
            (orphan.id, reason),
            (late.id, f"rejected: group {orphan_id} was dropped: {reason}"),
        ], (
            f"the dead stream must hold the orphan's sample with the drop reason {reason!r}, "
            f"then the late one rejected: {dead}"
        )
        info = await buffer_consumer(js, topology)
        assert (info.num_pending, info.num_ack_pending) == (0, 0), (
            f"{info.num_pending} undelivered and {info.num_ack_pending} unacked rewards left on "
            "the buffer's queue"
        )

    run_with_js(nats_server.url, body)


def test_max_group_wait_steps_defaults_to_the_wait_past_which_a_group_is_stale_anyway() -> None:
    assert RunConfig().staleness.group_wait_steps == 2  # max_staleness 1, + 1
    assert RunConfig(algorithm=AlgorithmConfig(max_staleness=5)).staleness.group_wait_steps == 6
    waits = AlgorithmConfig(max_staleness=5, max_group_wait_steps=3)
    assert RunConfig(algorithm=waits).staleness.group_wait_steps == 3
    with pytest.raises(
        ConfigError, match=r"config: algorithm.max_group_wait_steps: Input should be greater than"
    ):
        parse_config({"algorithm": {"max_group_wait_steps": 0}})
