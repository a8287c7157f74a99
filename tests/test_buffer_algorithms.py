"""The buffer process forms advantages as `algorithm` names them, against a real nats-server:
REINFORCE++ whitens over the whole step, DAPO's overlong penalty and filter shape the rewards of
long and cut responses, and pass@k refuses a group it cannot score (dropped with the reason)."""

from __future__ import annotations

from pathlib import Path

import torch
from nats.js import JetStreamContext

from bus.embedded import EmbeddedNats
from bus.topology import Topology
from engines.algorithms import advantages
from schemas import RewardEvent
from tests.buffer_feed import (
    batches,
    declare,
    drop_record,
    group,
    publish,
    run_with_js,
    start_buffer,
    stop_buffer,
    tail,
)
from tests.test_buffer_invariants import advantages_by_sample, config, settled


def cut(reward: RewardEvent) -> RewardEvent:
    """The same sample, its response cut by the token limit."""
    return reward.model_copy(
        update={"trajectory": reward.trajectory.model_copy(update={"finish_reason": "length"})}
    )


def run_buffer(
    url: str, topology: Topology, tmp_path: Path, fed: list[RewardEvent], **algorithm: object
) -> dict:
    """Feed `fed` to a buffer under `algorithm`; the (advantage, reward) of every batched sample."""
    log = tmp_path / "buffer.log"
    out: dict = {}

    async def body(js: JetStreamContext) -> None:
        await declare(js, topology, config(topology, **algorithm))
        await publish(js, topology, fed)
        proc = start_buffer(url, topology, log)
        try:
            await settled(js, topology, proc, log, f"algorithm {algorithm}")
        finally:
            stop_buffer(proc)
        assert proc.returncode == 0, f"buffer exit code {proc.returncode}:\n{tail(log)}"
        stored = await batches(js, topology)
        out["advantages"] = advantages_by_sample(stored)
        out["drops"] = {
            r.trajectory.prompt_id: await drop_record(js, topology, r.trajectory.prompt_id)
            for r in fed
        }

    run_with_js(url, body)
    return out


def test_reinforce_pp_whitens_over_every_group_of_the_step(
    nats_server: EmbeddedNats, topology: Topology, tmp_path: Path
) -> None:
    a, b = (
        group(topology.run, 0, (0.0, 1.0, 1.0, 3.0)),
        group(topology.run, 1, (2.0, 0.0, 0.0, 0.5)),
    )
    got = run_buffer(nats_server.url, topology, tmp_path, a + b, advantage="reinforce_pp")[
        "advantages"
    ]
    want = advantages.reinforce_pp(torch.tensor([r.reward for r in a + b]))
    have = torch.tensor([got[r.id][0] for r in a + b])
    torch.testing.assert_close(have, want, atol=1e-5, rtol=0)
    # Per group it would not be: group a alone has another mean and std.
    assert not torch.allclose(
        have[:4], advantages.reinforce_pp(torch.tensor([r.reward for r in a])), atol=1e-3
    )


def test_overlong_penalty_and_filter_shape_the_advantages(
    nats_server: EmbeddedNats, topology: Topology, tmp_path: Path
) -> None:
    # max_tokens 16, buffer 4: lengths 8, 14, 16 get penalties 0, -.5, -1; the 16 was cut.
    a = [
        group(topology.run, 0, (1.0,) * 4, response_tokens=n)[i]
        for i, n in enumerate((8, 14, 16, 8))
    ]
    a[3] = a[3].model_copy(update={"reward": 0.0})
    a[2] = cut(a[2])
    b = group(topology.run, 1, (2.0, 0.0, 0.0, 0.5))
    got = run_buffer(
        nats_server.url,
        topology,
        tmp_path,
        a + b,
        overlong_buffer_tokens=4,
        overlong_filter=True,
    )["advantages"]
    shaped = torch.tensor([1.0, 0.5, 0.0, 0.0])  # rewards [1, 1, 1, 0] + penalties
    want = advantages.grpo(shaped)
    want[2] = 0.0  # cut by the limit: filtered
    have = torch.tensor([got[r.id][0] for r in a])
    torch.testing.assert_close(have, want, atol=1e-5, rtol=0)
    assert [got[r.id][1] for r in a] == [1.0, 1.0, 1.0, 0.0], (
        "the batch carries the scored rewards, not shaped ones"
    )


def test_passk_drops_a_group_it_cannot_score_and_trains_the_others(
    nats_server: EmbeddedNats, topology: Topology, tmp_path: Path
) -> None:
    a, b = (
        group(topology.run, 0, (0.0, 1.0, 0.0, 0.0)),
        group(topology.run, 1, (1.0, 1.0, 0.0, 1.0)),
    )
    bad = group(topology.run, 2, (0.0, 0.5, 1.0, 0.0))
    out = run_buffer(nats_server.url, topology, tmp_path, a + bad + b, advantage="passk", passk_k=2)
    record = out["drops"][bad[0].trajectory.prompt_id]
    assert record is not None and "0 or 1" in record, (
        f"the 0.5 reward was not refused with a reason: {record!r}"
    )
    got = out["advantages"]
    assert not any(r.id in got for r in bad)
    for g in (a, b):
        want = advantages.passk(torch.tensor([r.reward for r in g]), 2)
        torch.testing.assert_close(torch.tensor([got[r.id][0] for r in g]), want, atol=1e-5, rtol=0)
