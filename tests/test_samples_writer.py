"""The main job's samples writer on a real server: a chosen group's rewards, read from the rewards
stream, are written once a step's metrics name its samples; other groups are not; a run whose
rewards stream cannot be read goes on without samples."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from bus.embedded import EmbeddedNats
from bus.topology import REWARDS, Topology
from producers.gate import Producer
from producers.launcher import attach_bootstrap
from producers.samples import SAMPLES_FILE, SamplesWriter
from schemas.config import RunConfig
from tests.helpers import reward


@pytest.mark.timeout(120)
def test_a_chosen_group_is_written_with_the_step_that_trained_it(
    nats_server: EmbeddedNats, topology: Topology, tmp_path: Path
) -> None:
    cfg = RunConfig(run=topology.run)  # report.samples_every 8: prompt 0's group, not 3's

    async def scenario() -> list[dict]:
        rt = await attach_bootstrap(cfg, nats_server.url)
        try:
            producer = Producer(rt)
            writer = SamplesWriter(producer, tmp_path)
            following = asyncio.create_task(writer.follow(every=0.1))
            for index in (0, 3):
                for sample in range(4):
                    event = reward(topology.run, index, sample, value=sample / 4)
                    await rt.publisher.publish(REWARDS, event)
            ids = [f"{topology.run}/0/{i}/{s}" for i in (0, 3) for s in range(4)]
            producer.metrics[0] = {"step": 0, "time": 0.0, "samples": 8, "sample_ids": ids}
            path = tmp_path / SAMPLES_FILE
            for _ in range(300):
                if path.exists() or following.done():
                    break
                await asyncio.sleep(0.1)
            following.cancel()
            await asyncio.gather(following, return_exceptions=True)
            writer.flush()  # as the job does at the run's end: every group still held
            assert path.exists(), "no group written"
            return [json.loads(line) for line in path.read_text().splitlines()]
        finally:
            await rt.close()

    groups = asyncio.run(scenario())
    assert [g["prompt_id"] for g in groups] == [f"{topology.run}/0/0"]
    group = groups[0]
    assert group["step"] == 0
    assert [r["reward"] for r in group["responses"]] == [0.0, 0.25, 0.5, 0.75]
    assert group["prompt"] is None and group["prompt_ids"] == [0, 1, 2, 3, 4]  # no tokenizer
    assert group["staleness"] == 0 and group["outcome"] == "trained"


@pytest.mark.timeout(120)
def test_a_run_whose_rewards_cannot_be_read_goes_on_without_samples(
    nats_server: EmbeddedNats, topology: Topology, tmp_path: Path
) -> None:
    cfg = RunConfig(run=topology.run)

    async def scenario() -> BaseException | None:
        rt = await attach_bootstrap(cfg, nats_server.url)
        try:
            await rt.js.delete_stream(topology.stream(REWARDS))
            try:
                await asyncio.wait_for(SamplesWriter(Producer(rt), tmp_path).follow(), 60)
            except Exception as exc:  # noqa: BLE001 - what would end the run is the finding
                return exc
            return None
        finally:
            await rt.close()

    failed = asyncio.run(scenario())
    assert failed is None, f"the samples writer would end the run: {failed!r}"
    assert not (tmp_path / SAMPLES_FILE).exists()
