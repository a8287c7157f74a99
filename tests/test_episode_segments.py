"""Every sample of a split agent episode is trained (issue 27): an episode whose template
stopped extending its tokens (`tests.chat_templates.CHATML_STRIPS_THINKING` drops an earlier
turn's `<think>`) is ONE trajectory carrying its earlier samples as segments
(`schemas.segment`), and the buffer packs a row per segment with the episode's advantage.

- Through a real rollout worker on a real nats-server (the production stage, the real HF
  engine with scripted turns, `tests.episode_script`): the stored trajectory's segments are
  exactly each sample's tokens, the template's render of the conversation at that turn, with
  each turn's weight version (new weights loaded between the two samples).
- Through the real reward stage and buffer process: the batch has a row per segment, each
  masked as its segment, all with the episode's id, advantage and reward.
- Through the real reference stage (in-process, its own builder, a tiny model): each segment
  is scored as its own sequence, `earlier_ref_logprobs` the earlier one's.
- The staleness bound and the group's oldest version count an earlier segment's old version.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from nats.js import JetStreamContext
from transformers import PreTrainedTokenizerFast

from bus.connection import connect
from bus.embedded import EmbeddedNats
from bus.runtime import attach, publish_config
from bus.stage import serve
from bus.topology import REWARDS, SCORED, Topology
from consumers import reference as reference_stage
from consumers.buffer_groups import Group
from consumers.packing import Row, arrays, bytes_per_token, row_too_long
from consumers.trainer_steps import step_metrics
from engines.reference import ReferenceEngine
from engines.tiny import build_tiny_model
from producers.samples import group_line
from producers.tasks import VOCAB
from schemas import BatchEvent, RewardEvent, Segment, Tensor, TrajectoryEvent, decode, encode
from schemas.config import AlgorithmConfig, DataConfig, RewardConfig, RunConfig, TrainerConfig
from schemas.staleness import StalenessPolicy
from tests.agent_tools import AskAgain
from tests.buffer_feed import batches, run_with_js, start_buffer, stop_buffer, tail
from tests.chat_templates import CHATML_STRIPS_THINKING, chat_tokenizer
from tests.episode_script import SCRIPT, THINK, build_chat_model
from tests.golden_events import golden
from tests.test_buffer_invariants import settled
from tests.test_episode_rollout import GROUP, episode_worker
from tests.test_reward import REVERSE, reverse_task, run_reward_worker
from tests.test_rollout_invariants import eventually


@pytest.fixture(scope="module")
def thinking_model(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[Path, PreTrainedTokenizerFast]:
    """The tiny Qwen2 of the episode tests, its tokenizer with a template that strips earlier
    reasoning (the same vocabulary: only the template differs)."""
    model_dir, _ = build_chat_model(tmp_path_factory.mktemp("thinking"))
    return model_dir, chat_tokenizer(CHATML_STRIPS_THINKING)


def render(tokenizer: PreTrainedTokenizerFast, messages: list[dict[str, Any]]) -> list[int]:
    ids = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=False, add_generation_prompt=True
    )
    assert isinstance(ids, list)
    return [i for i in ids if isinstance(i, int)]


def test_a_split_episode_is_one_trajectory_whose_segments_are_each_samples_tokens(
    nats_server: EmbeddedNats, topology: Topology, thinking_model: tuple[Path, Any]
) -> None:
    tokenizer = thinking_model[1]
    first_turn, second_turn = SCRIPT[THINK]

    async def main() -> list[TrajectoryEvent]:
        async with episode_worker(nats_server.url, topology, thinking_model, [], hold=True) as w:
            await w.publish_prompt(THINK)
            environment = w.episodes.environment
            assert isinstance(environment, AskAgain)
            # Both episodes made their reasoning turn (at v0); version 1 loads before the next.
            await eventually(lambda: environment.held == GROUP, "both episodes at their step")
            await w.publish_weights(1)
            await eventually(lambda: w.engine.version == 1, "version 1 loaded")
            environment.release.set()
            return await w.trajectories(GROUP)

    trajectories = asyncio.run(main())
    assert sorted(t.sample_index for t in trajectories) == list(range(GROUP))
    question = [{"role": "user", "content": THINK}]
    # The conversation at the second turn, as the template renders it: the first turn's
    # reasoning gone, so its tokens no longer extend the first sample's.
    asked = [*question, {"role": "assistant", "content": first_turn}]
    asked += [{"role": "user", "content": "Are you sure?"}]
    eos = tokenizer.eos_token_id
    turns = [[*tokenizer.encode(text, add_special_tokens=False), eos] for text in SCRIPT[THINK]]
    for t in trajectories:
        assert len(t.earlier) == 1, f"{len(t.earlier)} earlier segments"
        (earlier,) = t.earlier
        # Segment 0: the question rendered, then the reasoning turn as sampled (at v0).
        assert earlier.prompt_ids.numpy().tolist() == render(tokenizer, question)
        assert earlier.response_ids.numpy().tolist() == turns[0]
        assert earlier.response_mask.numpy().tolist() == [1] * len(turns[0])
        assert earlier.versions.numpy().tolist() == [0] * len(turns[0])
        np.testing.assert_allclose(earlier.logprobs.numpy(), -0.5)
        # The last sample: the stripped conversation rendered, then the answer (at v1).
        prompt = t.prompt_ids.numpy().tolist()
        assert prompt == render(tokenizer, asked)
        assert "<think>" not in tokenizer.decode(prompt)
        assert t.response_ids.numpy().tolist() == turns[1]
        assert t.response_mask is not None
        assert t.response_mask.numpy().tolist() == [1] * len(turns[1])
        assert t.versions.numpy().tolist() == [1] * len(turns[1])
        # Every segment's trained versions count, the earlier one's first.
        assert t.trained_versions().tolist() == [0] * len(turns[0]) + [1] * len(turns[1])
        episode = t.task["episode"]
        assert (episode["end"], episode["turns"], episode["samples"]) == ("done", 2, 2)
        assert second_turn in t.response_text


PROMPT = 3
SEGMENTS = {0: ([1, 1, 0, 1], [1, 1]), 1: ([1, 0, 0, 1, 1], [1, 1, 1])}
"""Sample -> its segments' masks: an earlier sample (model, tool result, model), then the last."""
TEXTS = {0: "321", 1: "32"}
"""Sample -> the text its reward function reads (rewards 1 and 2/3: the group is not dropped)."""


def segment_arrays(mask: list[int], first: int, version: int, vocab: int) -> dict[str, Tensor]:
    m = np.array(mask, np.uint8)
    prompt = np.arange(first, first + PROMPT, dtype=np.int32) % vocab
    response = np.arange(50 + first, 50 + first + m.size, dtype=np.int32) % vocab
    return {
        "prompt_ids": Tensor.from_numpy(prompt),
        "response_ids": Tensor.from_numpy(response),
        "logprobs": Tensor.from_numpy(np.where(m == 1, -0.75, 0.0).astype(np.float32)),
        "versions": Tensor.from_numpy(np.where(m == 1, version, -1).astype(np.int32)),
        "response_mask": Tensor.from_numpy(m),
    }


def split_episode(run: str, sample: int, vocab: int = 1000) -> TrajectoryEvent:
    earlier, last = SEGMENTS[sample]
    return TrajectoryEvent(
        id=f"{run}/0/0/{sample}",
        run=run,
        prompt_id=f"{run}/0/0",
        sample_index=sample,
        group_size=len(SEGMENTS),
        earlier=(Segment(**segment_arrays(earlier, 1, 0, vocab)),),
        **segment_arrays(last, 20, 0, vocab),
        response_text=TEXTS[sample],
        task=reverse_task("321"),
    )


@pytest.mark.timeout(180)
def test_a_split_episode_is_packed_a_row_per_segment_with_the_episodes_advantage(
    nats_server: EmbeddedNats, topology: Topology, tmp_path: Path
) -> None:
    config = RunConfig(
        run=topology.run,
        data=DataConfig(reward=REVERSE),
        reward=RewardConfig(timeout=5.0, processes=1),
        algorithm=AlgorithmConfig(prompts_per_step=1),
        trainer=TrainerConfig(micro_batch_tokens=64),
    )
    sent = {t.id: t for t in (split_episode(topology.run, s) for s in SEGMENTS)}
    rewards, dead, _ = run_reward_worker(nats_server, topology, config, list(sent.values()))
    assert not dead, dead
    assert {r.id: r.trajectory.earlier for r in rewards.values()} == {
        i: t.earlier for i, t in sent.items()
    }
    log = tmp_path / "buffer.log"
    stored: list[BatchEvent] = []

    async def body(js: JetStreamContext) -> None:
        proc = start_buffer(nats_server.url, topology, log)
        try:
            await settled(js, topology, proc, log, "a split episode's group")
        finally:
            stop_buffer(proc)
        assert proc.returncode == 0, f"buffer exit code {proc.returncode}:\n{tail(log)}"
        stored.extend(await batches(js, topology))

    run_with_js(nats_server.url, body)
    rows: dict[str, list[tuple[list[int], list[int], float, float]]] = {}
    for batch in stored:
        ids, loss = batch.input_ids.numpy(), batch.loss_mask.numpy()
        attention = batch.attention_mask.numpy()
        for row, sid in enumerate(batch.sample_ids):
            real = attention[row] == 1
            rows.setdefault(sid, []).append(
                (
                    ids[row][real].tolist(),
                    loss[row][real].tolist(),
                    float(batch.advantages.numpy()[row]),
                    float(batch.rewards.numpy()[row]),
                )
            )
    assert sorted(rows) == sorted(sent), f"batched {sorted(rows)}:\n{tail(log)}"
    advantage = {}
    for sid, t in sent.items():
        expected = sorted(
            (
                [*s.prompt.tolist(), *s.response.tolist()],
                [0] * s.prompt.size + (s.mask.tolist() if s.mask is not None else []),
            )
            for s in t.segments()
        )
        got = rows[sid]
        # One row per segment: its own tokens, its own mask as the loss mask.
        assert sorted((tokens, mask) for tokens, mask, _, _ in got) == expected, sid
        # Every row of the episode: its advantage and reward.
        assert len({(a, r) for _, _, a, r in got}) == 1, got
        advantage[sid] = got[0][2]
        assert got[0][3] == pytest.approx(rewards[sid].reward)
    # The group's two episodes (rewards 1 and 2/3) have advantages of opposite signs.
    assert advantage[f"{topology.run}/0/0/0"] > 0 > advantage[f"{topology.run}/0/0/1"]


@pytest.mark.timeout(180)
def test_the_reference_stage_scores_each_segment_as_its_own_sequence(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    run = f"refseg{int(time.time() * 1000) % 10**8}"
    model_dir = build_tiny_model(tmp_path / "model", VOCAB)
    config = RunConfig.model_validate(
        {"run": run, "model": {"path": str(model_dir)}, "reference": {"enabled": True}}
    )
    topology = Topology.for_config(config)
    trajectory = split_episode(run, 0, vocab=len(VOCAB))  # ids the tiny model takes
    reward = RewardEvent(id=trajectory.id, run=run, trajectory=trajectory, reward=1.0)

    async def scenario() -> RewardEvent:
        nc = await connect(nats_server.url, "test-reference-segments")
        js = nc.jetstream()
        await topology.apply(js)
        await publish_config(await js.key_value(topology.kv_bucket), config)
        rt = await attach("reference", run, nats_server.url)
        stage = await reference_stage.build(rt)
        stop = asyncio.Event()
        task = asyncio.create_task(serve(rt, stage, stop))
        try:
            await js.publish(topology.subject(REWARDS), encode(reward))
            sub = await js.subscribe(topology.subjects(SCORED), ordered_consumer=True)
            out = decode((await sub.next_msg(timeout=60)).data, RewardEvent)
            await sub.unsubscribe()
            assert not task.done(), "the reference stage stopped"
        finally:
            stop.set()
            await asyncio.gather(task, return_exceptions=True)
            if stage.close is not None:
                await stage.close()
            await rt.close()
            await topology.delete(js)
            await nc.close()
        return out

    out = asyncio.run(scenario())
    engine = ReferenceEngine(model_dir)
    segments = trajectory.segments()
    alone = engine.logprobs([(s.prompt, s.response) for s in segments])
    refs = out.ref_segments()
    assert refs is not None and len(refs) == len(segments) == 2
    for got, expected in zip(refs, alone, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    # Scored after its own prompt, not the last sample's: the earlier segment's response after
    # the last prompt gives other log-probs.
    wrong = engine.logprobs([(segments[1].prompt, segments[0].response)])[0]
    assert not np.allclose(refs[0], wrong, atol=1e-5)


def golden_split() -> RewardEvent:
    reward = golden()["reward.v4"]
    assert isinstance(reward, RewardEvent)
    return reward


def test_the_staleness_bound_counts_an_earlier_segments_old_version() -> None:
    reward = golden_split()  # its earlier segment at v2, its last sample at v3 and v4
    assert reward.trajectory.versions.numpy().max() == 4
    group = Group(reward.trajectory.prompt_id, 2)
    group.add(reward, None)  # type: ignore[arg-type]  # the Msg is only held
    assert group.min_version == 2
    policy = StalenessPolicy(bound=2, prompts_per_step=1, steps=10, checkpoint_every=1)
    # At step 5 the oldest allowed is v3: the last sample alone would train; the episode not.
    assert not policy.too_old(3, 5)
    assert policy.too_old(group.min_version, 5)
    # The samples file's version and staleness count it too, and say it has two segments.
    (response,) = group_line([reward], None, step=5)["responses"]
    assert (response["version"], response["staleness"], response["segments"]) == (2, 3, 2)


def test_a_split_episode_fits_a_batch_event_when_its_longest_segment_does() -> None:
    """Each segment is a row of its own: the buffer's check that a sample can ever be batched
    takes the longest segment, not the episode's sum (which no row ever holds)."""
    t = split_episode("fit", 1)  # segments of 3 + 5 and 3 + 3 tokens: 8 is the longest
    per_token = bytes_per_token(reference=False, turn_rewards=False)
    assert row_too_long(t, per_token, max_payload=2 * 8 * per_token) is None  # 14 tokens in all
    assert row_too_long(t, per_token, max_payload=2 * 8 * per_token - 1) == (
        "a row of 8 tokens cannot fit one batch event"
    )


def test_packing_places_each_segments_reference_and_turn_rewards_in_its_row() -> None:
    reward = golden_split()
    first, last = Row.all_of(reward, 0.5, "")
    assert (first.sample_id, last.sample_id) == (reward.id, reward.id)
    mb = arrays([first, last])
    # Row 0: the earlier segment (2 prompt tokens, mask [1, 1, 0, 1]), padded to 8.
    assert mb.loss_mask.tolist() == [[0, 0, 1, 1, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0, 0, 1]]
    assert mb.versions.tolist()[0] == [-1, -1, 2, 2, -1, 3, -1, -1]
    assert mb.ref_logprobs is not None
    assert mb.ref_logprobs.tolist()[0] == [0, 0, -0.5, -0.5, 0, -1.5, 0, 0]
    # Turn rewards [0.5, 0, 0.25, 0]: the earlier segment's two turns, then the last's two.
    assert mb.token_rewards is not None
    assert mb.token_rewards.tolist() == [[0, 0, 0, 0.5, 0, 0, 0, 0], [0, 0, 0, 0, 0.25, 0, 0, 0]]
    assert mb.advantages.tolist() == [0.5, 0.5] and mb.rewards.tolist() == [1.0, 1.0]


def test_the_trainers_step_record_counts_a_split_episode_once() -> None:
    """Its rows share one id and one reward: the step's samples, ids and reward mean count it
    once (the audit's "trained exactly once" and the progress line read these)."""
    split, plain = golden_split(), golden()["reward.v1"]
    assert isinstance(plain, RewardEvent)
    mb = arrays([*Row.all_of(split, 0.5, ""), *Row.all_of(plain, -0.5, "")])
    batch = BatchEvent(
        id="g/step/5/0/0",
        run="g",
        step=5,
        dp_rank=0,
        dp_size=1,
        micro_index=0,
        micro_count=1,
        input_ids=Tensor.from_numpy(mb.input_ids),
        attention_mask=Tensor.from_numpy(mb.attention_mask),
        loss_mask=Tensor.from_numpy(mb.loss_mask),
        advantages=Tensor.from_numpy(mb.advantages),
        behaviour_logprobs=Tensor.from_numpy(mb.behaviour_logprobs),
        versions=Tensor.from_numpy(mb.versions),
        rewards=Tensor.from_numpy(mb.rewards),
        sample_ids=tuple(r.sample_id for r in mb.rows),
    )
    assert batch.sample_ids == (split.id, split.id, plain.id)
    record = step_metrics(5, [batch], {}, 1.0)
    assert (record["samples"], record["sample_ids"]) == (2, [split.id, plain.id])
    assert record["reward_mean"] == pytest.approx((1.0 + 0.5) / 2)
