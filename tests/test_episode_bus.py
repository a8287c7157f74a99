"""A multi-turn episode's mask through the real bus: masked trajectories published on the
trajectories stream are scored by the reward stage (in-process, its own builder), batched by
the buffer process (`python -m consumers.buffer`), and land in a BatchEvent whose loss mask over
each response is the trajectory's `response_mask`, with versions -1 and log-probs 0.0 there."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from nats.js import JetStreamContext

from bus.embedded import EmbeddedNats
from bus.topology import Topology
from schemas import BatchEvent, Tensor, TrajectoryEvent
from schemas.config import AlgorithmConfig, DataConfig, RewardConfig, RunConfig, TrainerConfig
from tests.buffer_feed import batches, run_with_js, start_buffer, stop_buffer, tail
from tests.test_buffer_invariants import settled
from tests.test_reward import REVERSE, reverse_task, run_reward_worker

PROMPT = 4
MASKS = {0: [1, 1, 0, 0, 0, 1, 1], 1: [1, 0, 1, 1]}
"""Sample -> its response's mask: model tokens, a tool result and turn header, model tokens."""
TEXTS = {0: "321", 1: "32"}
"""Sample -> the text its reward function reads (rewards 1 and 2/3: the group is not dropped)."""


def episode(run: str, sample: int) -> TrajectoryEvent:
    mask = np.array(MASKS[sample], np.uint8)
    n = len(mask)
    return TrajectoryEvent(
        id=f"{run}/0/0/{sample}",
        run=run,
        prompt_id=f"{run}/0/0",
        sample_index=sample,
        group_size=len(MASKS),
        prompt_ids=Tensor.from_numpy(np.arange(1, PROMPT + 1, dtype=np.int32)),
        response_ids=Tensor.from_numpy(np.arange(10, 10 + n, dtype=np.int32)),
        logprobs=Tensor.from_numpy(np.where(mask == 1, -0.75, 0.0).astype(np.float32)),
        versions=Tensor.from_numpy(np.where(mask == 1, 0, -1).astype(np.int32)),
        response_text=TEXTS[sample],
        task=reverse_task("321"),
        response_mask=Tensor.from_numpy(mask),
    )


@pytest.mark.timeout(180)
def test_a_masked_episode_reaches_the_batch_with_its_mask(
    nats_server: EmbeddedNats, topology: Topology, tmp_path: Path
) -> None:
    config = RunConfig(
        run=topology.run,
        data=DataConfig(reward=REVERSE),
        reward=RewardConfig(timeout=5.0, processes=1),
        algorithm=AlgorithmConfig(prompts_per_step=1),
        trainer=TrainerConfig(micro_batch_tokens=64),
    )
    sent = [episode(topology.run, sample) for sample in MASKS]
    rewards, dead, _ = run_reward_worker(nats_server, topology, config, list(sent))
    assert not dead, dead
    assert {r.id: r.trajectory.response_mask for r in rewards.values()} == {
        t.id: t.response_mask for t in sent
    }
    log = tmp_path / "buffer.log"
    stored: list[BatchEvent] = []

    async def body(js: JetStreamContext) -> None:
        proc = start_buffer(nats_server.url, topology, log)
        try:
            await settled(js, topology, proc, log, "a masked episode's group")
        finally:
            stop_buffer(proc)
        assert proc.returncode == 0, f"buffer exit code {proc.returncode}:\n{tail(log)}"
        stored.extend(await batches(js, topology))

    run_with_js(nats_server.url, body)
    rows = {sid: (batch, row) for batch in stored for row, sid in enumerate(batch.sample_ids)}
    assert sorted(rows) == sorted(t.id for t in sent), f"batched {sorted(rows)}:\n{tail(log)}"
    for t in sent:
        batch, row = rows[t.id]
        n = PROMPT + len(MASKS[t.sample_index])
        mask = batch.loss_mask.numpy()[row]
        assert mask[:n].tolist() == [0] * PROMPT + MASKS[t.sample_index], t.id
        assert not mask[n:].any()
        env = np.flatnonzero(np.array([0] * PROMPT + MASKS[t.sample_index]) == 0)
        assert (batch.versions.numpy()[row][env] == -1).all()
        assert (batch.behaviour_logprobs.numpy()[row][env] == 0.0).all()
        assert (batch.versions.numpy()[row][mask == 1] == 0).all()
