"""Per-turn rewards (`agent.turn_rewards`, issue 27): each model turn's reward on its last token.

- The placement (`schemas.turn_rewards`): reward k on the last token of the k-th run of model
  tokens, and nothing placed when the counts disagree.
- GAE with token rewards against hand-computed values; the critic adds a batch's
  `token_rewards` to the outcome, which stays on the last loss token once.
- The config refuses the option without `gae` and an environment, in one line.
- Dynamic sampling drops a group as equal only when its turn rewards are equal too.
- The events: `RewardEvent.turn_rewards` [K] and `BatchEvent.token_rewards` [B, T] checked,
  round-tripped, their golden bytes decoded; older events read as having none.
- End to end on a real nats-server: a rollout worker's episode (a tool call, an answer the
  environment rewards 0.25 and asks again, a final answer) scored by a real reward process,
  batched by a real buffer process: the batch carries 0.25 on the last token of the second
  turn, and the critic's returns count it on that turn's tokens and before, the outcome once.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from pydantic import ValidationError

from bus.embedded import EmbeddedNats
from bus.topology import Topology
from consumers.buffer_groups import Group
from consumers.reward import turn_rewards
from consumers.reward_pool import Score
from consumers.trainer_steps import micro_batch
from engines.algorithms import gae
from engines.critic import CriticConfig
from engines.torch_train import TorchTrainEngine
from schemas import BatchEvent, DecodeError, RewardEvent, Tensor, decode, encode
from schemas.agent_config import AgentConfig
from schemas.config import ConfigError, RunConfig, validate
from schemas.kv_records import DropKind
from schemas.turn_rewards import place, sample_turn_rewards, turn_ends
from tests.buffer_feed import ROOT, SETTLE, batches, start_buffer, stop_buffer, tail, until
from tests.episode_script import ADD, QUESTION, ScriptedEngine, build_chat_model
from tests.golden_events import GOLDEN, golden
from tests.test_episode_rollout import EpisodeWorker
from tests.test_rollout_invariants import served_rollout


def f32(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32)


# ---- placement -----------------------------------------------------------------------------


def test_each_turns_reward_goes_on_the_last_token_of_its_run_of_model_tokens() -> None:
    # turns: [0, 1], [4, 5, 6], [8]; the environment's tokens 2-3 and 7 between them.
    mask = np.array([1, 1, 0, 0, 1, 1, 1, 0, 1], dtype=np.uint8)
    assert turn_ends(mask, 9).tolist() == [1, 6, 8]
    placed = place(f32(0.5, -1.0, 2.0), mask, 9)
    assert placed.dtype == np.float32
    assert placed.tolist() == [0, 0.5, 0, 0, 0, 0, -1.0, 0, 2.0]
    # A response ending in environment tokens (trimmed in practice) still ends its turn at the
    # last model token; a single-turn response (no mask) is one turn ending at its last token.
    assert turn_ends(np.array([0, 1, 1, 0, 0], np.uint8), 5).tolist() == [2]
    assert place(f32(3.0), None, 4).tolist() == [0, 0, 0, 3.0]
    assert turn_ends(None, 0).tolist() == []
    # Counts that disagree place nothing: a reward is never put on another turn's token.
    with pytest.raises(ValueError, match="2 turn rewards for 3 model turns"):
        place(f32(1.0, 2.0), mask, 9)


def test_the_stored_sample_takes_the_last_of_the_episodes_turn_rewards() -> None:
    # An episode that split (the render stopped extending its tokens) stores its last sample:
    # its 2 turns are the episode's last 2.
    assert sample_turn_rewards([0.1, 0.2, 0.3], 2) == pytest.approx([0.2, 0.3])
    assert sample_turn_rewards([0.1, 0.2, 0.3], 3) == pytest.approx([0.1, 0.2, 0.3])
    # A record written before the option: the turns with no reward recorded get 0.
    assert sample_turn_rewards([0.3], 2) == pytest.approx([0.0, 0.3])


# ---- GAE -----------------------------------------------------------------------------------


def test_gae_with_token_rewards_by_hand() -> None:
    # Row 0: prompt token then 3 response tokens, V = .5 .6 .7, outcome R = 1, and a turn that
    # ends at t1 rewarded .5; gamma .9, lambda .8 (gamma lambda = .72):
    #   t3: delta = 1 - .7 = .3,                         A = .3
    #   t2: delta = .9 * .7 - .6 = .03,                  A = .03 + .72 * .3 = .246
    #   t1: delta = .5 + .9 * .6 - .5 = .54,             A = .54 + .72 * .246 = .71712
    # Row 1: loss tokens 0, 1, 2; a turn reward .25 on its last loss token (t2) with outcome 2:
    # they add there, 2.25 (the outcome once); a reward off the mask (t3) counts for nothing.
    #   t2: delta = 2.25 - .4 = 1.85,                    A = 1.85
    #   t1: delta = .9 * .4 - .3 = .06,                  A = .06 + .72 * 1.85 = 1.392
    #   t0: delta = .9 * .3 - .2 = .07,                  A = .07 + .72 * 1.392 = 1.07224
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.float32)
    values = torch.tensor([[9.0, 0.5, 0.6, 0.7], [0.2, 0.3, 0.4, 7.0]])
    inside = torch.tensor([[0, 0.5, 0, 0], [0, 0, 0.25, 4.0]])
    rewards = gae.token_rewards(torch.tensor([1.0, 2.0]), mask, inside)
    torch.testing.assert_close(rewards, torch.tensor([[0, 0.5, 0, 1.0], [0, 0, 2.25, 0]]))
    adv, ret = gae.gae_advantages(rewards, values * mask, mask, gamma=0.9, lam=0.8)
    expected = torch.tensor([[0, 0.71712, 0.246, 0.3], [1.07224, 1.392, 1.85, 0]])
    torch.testing.assert_close(adv, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(ret, (expected + values) * mask, atol=1e-5, rtol=0)
    # None: the outcome alone, exactly as before the option.
    torch.testing.assert_close(
        gae.token_rewards(torch.tensor([1.0, 2.0]), mask),
        gae.outcome_rewards(torch.tensor([1.0, 2.0]), mask),
    )


# ---- config --------------------------------------------------------------------------------

ENV = "tests.agent_tools:AskAgain"


def refusal(sections: dict) -> str | None:
    """The one-line error the config gives for `sections`; None when it takes them."""
    try:
        validate(RunConfig, sections, "run.yaml")
    except ConfigError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize(
    "sections",
    [
        {"agent": {"environment": ENV, "turn_rewards": True}},  # grpo, the default
        {"agent": {"tools": [ADD], "turn_rewards": True}, "algorithm": {"advantage": "gae"}},
    ],
)
def test_the_config_refuses_turn_rewards_without_gae_and_an_environment(sections: dict) -> None:
    message = refusal(sections)
    assert message is not None and "\n" not in message
    assert "agent.turn_rewards needs algorithm.advantage gae and an agent.environment" in message


def test_the_config_takes_turn_rewards_with_gae_and_an_environment() -> None:
    sections = {
        "agent": {"environment": ENV, "turn_rewards": True},
        "algorithm": {"advantage": "gae"},
    }
    assert refusal(sections) is None
    assert validate(RunConfig, sections, "run.yaml").agent == AgentConfig(
        environment=ENV, turn_rewards=True
    )
    # Per episode by default, with any estimator.
    assert refusal({"agent": {"environment": ENV}}) is None
    assert AgentConfig().turn_rewards is False


# ---- events --------------------------------------------------------------------------------


def episode_reward(turns: np.ndarray | None) -> RewardEvent:
    """The golden episode (model tokens 0-1 and 4: two turns) with these turn rewards."""
    reward = golden()["reward.v3"]
    assert isinstance(reward, RewardEvent)
    update = {"turn_rewards": None if turns is None else Tensor.from_numpy(turns)}
    return RewardEvent.model_validate({**dict(reward), **update})


def test_reward_events_carry_one_finite_reward_per_model_turn() -> None:
    reward = episode_reward(f32(0.25, 0.0))
    assert decode(encode(reward), RewardEvent) == reward
    with pytest.raises(ValidationError, match="3 turn rewards for 2 model turns"):
        episode_reward(f32(0.25, 0.0, 1.0))
    with pytest.raises(ValidationError, match="turn_rewards"):
        episode_reward(f32(np.nan, 0.0))
    with pytest.raises(ValidationError, match="turn_rewards"):
        episode_reward(np.array([0.25, 0.0], dtype=np.float64))  # float32 only


def test_batch_events_carry_token_rewards_shaped_as_the_batch_and_on_the_loss_mask() -> None:
    batch = golden()["batch.v2"]
    assert isinstance(batch, BatchEvent) and batch.token_rewards is not None
    assert decode(encode(batch), BatchEvent) == batch
    fields = dict(batch)

    def with_rewards(values: np.ndarray) -> BatchEvent:
        return BatchEvent.model_validate({**fields, "token_rewards": Tensor.from_numpy(values)})

    with pytest.raises(ValidationError, match=r"token_rewards has shape \(2, 3\), expected"):
        with_rewards(np.zeros((2, 3), np.float32))
    with pytest.raises(ValidationError, match="token_rewards"):
        with_rewards(np.full((2, 4), np.inf, np.float32))
    off = np.zeros((2, 4), np.float32)
    off[0, 0] = 1.0  # row 0's prompt token: off the loss mask
    with pytest.raises(ValidationError, match="0 off the loss mask"):
        with_rewards(off)


def test_golden_turn_rewards_decode_and_older_events_read_as_having_none() -> None:
    reward = decode((GOLDEN / "reward.v3.msgpack").read_bytes(), RewardEvent)
    assert reward.turn_rewards is not None
    assert reward.turn_rewards.numpy().tolist() == [0.25, 0.0]
    batch = decode((GOLDEN / "batch.v2.msgpack").read_bytes(), BatchEvent)
    assert batch.token_rewards is not None
    assert batch.token_rewards.numpy().tolist() == [[0, 0, 0, 0.5], [0, -0.25, 0, 0]]
    for name in ("reward.v1", "reward.v2"):
        old = decode((GOLDEN / f"{name}.msgpack").read_bytes(), RewardEvent)
        assert (old.schema_version, old.turn_rewards) == (RewardEvent.VERSION, None)
    old_batch = decode((GOLDEN / "batch.v1.msgpack").read_bytes(), BatchEvent)
    assert (old_batch.schema_version, old_batch.token_rewards) == (3, None)
    # An older version's map that names the new field is no such version: refused.
    v2 = msgpack.unpackb((GOLDEN / "reward.v2.msgpack").read_bytes())
    with pytest.raises(DecodeError, match="schema_version 2 has no turn_rewards"):
        decode(msgpack.packb({**v2, "turn_rewards": None}))
    v1 = msgpack.unpackb((GOLDEN / "batch.v1.msgpack").read_bytes())
    with pytest.raises(DecodeError, match="schema_version 1 has no token_rewards"):
        decode(msgpack.packb({**v1, "token_rewards": None}))


def test_the_reward_worker_fails_a_sample_whose_turn_rewards_do_not_fit_its_turns() -> None:
    episode = episode_reward(None).trajectory
    task = {**episode.task, "episode": {"turn_rewards": [0.25, 0.0]}}
    turns, score = turn_rewards(episode.model_copy(update={"task": task}), Score(1.0))
    assert turns is not None and turns.tolist() == [0.25, 0.0] and not score.failed
    task = {**episode.task, "episode": {"turn_rewards": [0.25]}}
    turns, score = turn_rewards(episode.model_copy(update={"task": task}), Score(1.0))
    assert turns is None and score.failed and score.reward == 0.0
    assert score.reason == "turn rewards: 1 turn rewards for 2 model turns in the response mask"


# ---- end to end ----------------------------------------------------------------------------

TURN_REWARD = 0.25


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    return build_chat_model(tmp_path_factory.mktemp("chat"))


def start_reward(url: str, topology: Topology, log: Path) -> subprocess.Popen[bytes]:
    """The reward stage as a process, as a fleet starts it."""
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "consumers.reward", "--run", topology.run, "--nats", url],
            cwd=ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
        )


def test_an_episodes_turn_reward_reaches_the_critic_through_the_reward_and_buffer_processes(
    nats_server: EmbeddedNats, topology: Topology, chat_model: tuple[Path, Any], tmp_path: Path
) -> None:
    model_dir, tokenizer = chat_model
    sections = {
        "data": {"n": 2, "reward": "engines.environment:environment_reward"},
        "algorithm": {
            "advantage": "gae",
            "prompts_per_step": 1,
            "drop_equal_reward_groups": False,  # both episodes answer 42: equal outcomes
        },
        "agent": {
            "environment": ENV,
            "environment_options": {"turn_reward": TURN_REWARD},
            "tools": [ADD],
            "max_turns": 4,
            "turn_rewards": True,
        },
        "reward": {"processes": 1, "isolation": "off"},
    }
    logs = tmp_path / "reward.log", tmp_path / "buffer.log"

    async def main() -> list[BatchEvent]:
        engine = ScriptedEngine(model_dir, tokenizer)
        async with served_rollout(
            nats_server.url, topology, model_dir, engine, {}, sections=sections, tokenizer=tokenizer
        ) as (_, js, _, rollout):
            worker = EpisodeWorker(js, topology, engine, rollout)
            await worker.publish_weights(0)
            await worker.publish_prompt(QUESTION)
            trajectories = await worker.trajectories(2)
            for t in trajectories:  # the tool call's turn 0, the asked-again turn .25, the end 0
                assert t.task["episode"]["turn_rewards"] == [0.0, TURN_REWARD, 0.0]
                assert t.task["episode"]["reward"] == 1.0  # the outcome, apart
            procs = [
                start_reward(nats_server.url, topology, logs[0]),
                start_buffer(nats_server.url, topology, logs[1]),
            ]
            try:

                async def stored() -> bool:
                    return len(await batches(js, topology)) >= 1

                async def why() -> str:
                    return f"no batch after {SETTLE:.0f} s:\n{tail(logs[0])}\n{tail(logs[1])}"

                await until(stored, SETTLE, why)
            finally:
                for proc in procs:
                    stop_buffer(proc)  # SIGTERM, then SIGKILL: the same for the reward stage
            return await batches(js, topology)

    (batch,) = asyncio.run(main())
    assert batch.token_rewards is not None
    token_rewards, loss = batch.token_rewards.numpy(), batch.loss_mask.numpy()
    for row in range(2):
        # The second run of loss tokens is the asked-again turn: .25 on its last token only.
        edges = np.diff(np.concatenate([[0], loss[row], [0]]))
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1) - 1
        assert len(starts) == 3
        expected = np.zeros_like(token_rewards[row])
        expected[ends[1]] = TURN_REWARD
        assert token_rewards[row].tolist() == expected.tolist()
        assert batch.rewards.numpy()[row] == 1.0
    # The critic (its head starts at zero: V = 0) with gamma = lambda = 1: each token's return
    # is the rewards from it on, the turn's .25 on turns 0 and 1, the outcome 1 once on all.
    eng = TorchTrainEngine(model_dir, lr=1e-3, critic=CriticConfig(lr=1e-3, gamma=1.0, lam=1.0))
    assert eng.critic is not None
    _, (targets,), _ = eng.critic.prepare([micro_batch(batch)], 1.0)
    returns = targets.returns.numpy()
    for row in range(2):
        edges = np.diff(np.concatenate([[0], loss[row], [0]]))
        second_end = np.flatnonzero(edges == -1)[1] - 1
        before = np.arange(loss.shape[1]) <= second_end
        expected = np.where(before, 1.0 + TURN_REWARD, 1.0) * loss[row]
        np.testing.assert_allclose(returns[row], expected, atol=1e-6)


def test_a_group_of_equal_outcomes_but_different_turn_rewards_is_not_dropped_as_equal() -> None:
    def sample(index: int, turns: np.ndarray | None) -> RewardEvent:
        reward = episode_reward(turns)
        t = reward.trajectory.model_copy(update={"id": f"g/0/3/{index}", "sample_index": index})
        fields = {**dict(reward), "id": t.id, "trajectory": t}
        return RewardEvent.model_validate(fields)

    def dropped(*turns: np.ndarray | None) -> DropKind | None:
        group = Group("g/0/3", len(turns))
        for i, t in enumerate(turns):
            group.samples[i] = (sample(i, t), None)  # type: ignore[assignment]
        record = group.drop_record(drop_equal=True)
        return None if record is None else record.kind

    assert dropped(f32(0.25, 0.0), f32(0.0, 0.0)) is None  # the turns tell them apart
    assert dropped(f32(0.25, 0.0), f32(0.25, 0.0)) is DropKind.EQUAL
    assert dropped(None, None) is DropKind.EQUAL  # per episode: as ever
