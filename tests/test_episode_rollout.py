"""Agent episodes through a real rollout worker (`consumers.episodes`), on a real nats-server.

The worker is the production stage (`served_rollout`), its engine the real HF engine over a
tiny Qwen2 whose model turns are scripted (`ScriptedEngine`: what the model says is the
test's; versions, weight loads, the copies, slots and router are the real ones), its tokenizer
a ChatML one with tools in its template (`tests.chat_templates`), its tools run in the real
sandboxed tool processes (`consumers.tool_runner`).

- An episode (a tool call, its result, an answer, the environment's question, a second
  answer) is ONE trajectory whose tokens are the whole conversation rendered once, whose mask
  covers exactly the model's tokens, and whose per-token versions are those each turn was
  generated with (new weights loaded while the environment held the episodes).
- A hanging tool, a crashing one and one returning 10 MB each fail their episode with the
  reason, stored as a trajectory (`finish_reason` "error"), and the worker goes on to the
  next prompt. An episode whose last turn was cut at its token limit reads as "length".
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from nats.js import JetStreamContext
from transformers import PreTrainedTokenizerFast

from bus.embedded import EmbeddedNats
from bus.topology import PROMPTS, WEIGHTS, Topology
from consumers.episodes import EpisodeRunner
from consumers.rollout import Rollout
from engines.tools import load_tools, prompt_with_tools
from schemas import TrajectoryEvent, encode
from tests.agent_tools import AskAgain
from tests.episode_script import (
    ADD,
    FNS,
    QUESTION,
    SCRIPT,
    ScriptedEngine,
    build_chat_model,
)
from tests.episode_script import question as prompt_for
from tests.helpers import store_weights, stored_trajectories
from tests.test_rollout_invariants import eventually, served_rollout

GROUP = 2


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PreTrainedTokenizerFast]:
    """A tiny random Qwen2 over the ChatML test tokenizer's vocabulary, and that tokenizer."""
    return build_chat_model(tmp_path_factory.mktemp("chat"))


@dataclass
class EpisodeWorker:
    js: JetStreamContext
    topology: Topology
    engine: ScriptedEngine
    rollout: Rollout
    published: int = 0

    @property
    def episodes(self) -> EpisodeRunner:
        assert self.rollout.episodes is not None
        return self.rollout.episodes

    async def publish_prompt(self, question: str) -> None:
        index, self.published = self.published, self.published + 1
        event = prompt_for(self.topology.run, index, question, GROUP)
        await self.js.publish(self.topology.subject(PROMPTS), encode(event))

    async def publish_weights(self, version: int) -> None:
        params = {
            name: p.detach().clone() + 1e-3 * version
            for name, p in self.engine.model.named_parameters()
        }
        event = await store_weights(self.js, self.topology, version, params)
        await self.js.publish(self.topology.subject(WEIGHTS), encode(event))

    async def trajectories(self, count: int) -> list[TrajectoryEvent]:
        return await stored_trajectories(self.js, self.topology, count)


@asynccontextmanager
async def episode_worker(
    url: str,
    topology: Topology,
    chat: tuple[Path, PreTrainedTokenizerFast],
    tools: list[str],
    *,
    hold: bool = False,
    tool_timeout: float = 30.0,
) -> AsyncIterator[EpisodeWorker]:
    model_dir, tokenizer = chat
    engine = ScriptedEngine(model_dir, tokenizer)
    sections = {
        "data": {"n": GROUP},
        "agent": {
            "environment": "tests.agent_tools:AskAgain",
            "environment_options": {"hold": hold},
            "tools": tools,
            "max_turns": 4,
        },
        "tools": {"timeout": tool_timeout},
    }
    async with served_rollout(
        url, topology, model_dir, engine, {}, sections=sections, tokenizer=tokenizer
    ) as (_, js, _, rollout):
        worker = EpisodeWorker(js, topology, engine, rollout)
        await worker.publish_weights(0)  # opens the gate, as the trainer's v0 does
        yield worker


def render(
    tokenizer: PreTrainedTokenizerFast, messages: list[dict[str, Any]], prompt: bool = False
) -> list[int]:
    tools: list[dict[Any, Any] | Callable[..., Any]] = [*load_schemas()]
    ids = tokenizer.apply_chat_template(
        messages, tools=tools, tokenize=True, return_dict=False, add_generation_prompt=prompt
    )
    assert isinstance(ids, list)
    return [i for i in ids if isinstance(i, int)]


def load_schemas() -> list[dict[str, Any]]:
    return [tool.schema for tool in load_tools([ADD]).values()]


def test_an_episode_is_one_trajectory_of_the_tokens_the_model_saw_with_per_token_versions(
    nats_server: EmbeddedNats, topology: Topology, chat_model: tuple[Path, Any]
) -> None:
    tokenizer = chat_model[1]
    model_turns = SCRIPT[QUESTION]

    async def main() -> list[TrajectoryEvent]:
        async with episode_worker(nats_server.url, topology, chat_model, [ADD], hold=True) as w:
            await w.publish_prompt(QUESTION)
            environment = w.episodes.environment
            assert isinstance(environment, AskAgain)
            # Both episodes made their tool call and answered once: the environment holds them
            # (holding no engine slot) while version 1 loads.
            await eventually(lambda: environment.held == GROUP, "both episodes at their step")
            await w.publish_weights(1)
            await eventually(lambda: w.engine.version == 1, "version 1 loaded")
            environment.release.set()
            return await w.trajectories(GROUP)

    trajectories = asyncio.run(main())
    assert sorted(t.sample_index for t in trajectories) == list(range(GROUP))
    messages, template_tools = prompt_with_tools(
        tokenizer, [{"role": "user", "content": QUESTION}], load_schemas()
    )
    assert template_tools is not None  # the ChatML template renders the tools itself
    conversation = [
        *messages,
        {"role": "assistant", "content": model_turns[0]},
        {"role": "tool", "name": "add", "content": "42"},
        {"role": "assistant", "content": model_turns[1]},
        {"role": "user", "content": "Are you sure?"},
        {"role": "assistant", "content": model_turns[2]},
    ]
    once = render(tokenizer, conversation)
    turns = [
        [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
        for text in model_turns
    ]
    for t in trajectories:
        prompt, response = t.prompt_ids.numpy(), t.response_ids.numpy()
        assert t.response_mask is not None and t.versions is not None
        mask, versions = t.response_mask.numpy(), t.versions.numpy()
        logprobs = t.logprobs.numpy()
        # Token-exact: the whole conversation rendered once (less the newline the template puts
        # after the last end of turn, where the model stopped).
        built = [*prompt.tolist(), *response.tolist()]
        assert once[: len(built)] == built and tokenizer.decode(once[len(built) :]) == "\n"
        assert prompt.tolist() == render(tokenizer, messages, prompt=True)
        # The mask is exactly the model's tokens, in order, each turn's at its place.
        assert response[mask == 1].tolist() == [i for turn in turns for i in turn]
        starts = np.flatnonzero(np.diff(np.concatenate([[0], mask])) == 1)
        assert len(starts) == 3
        for start, ids in zip(starts, turns, strict=True):
            assert response[start : start + len(ids)].tolist() == ids
        # Each model token's version and log-prob: turns 0 and 1 at v0, turn 2 (after the
        # environment's question, generated once v1 loaded) at v1; -1 and 0.0 where masked.
        expected_versions = np.concatenate(
            [np.full(len(ids), v) for ids, v in zip(turns, [0, 0, 1], strict=True)]
        )
        assert versions[mask == 1].tolist() == expected_versions.tolist()
        assert set(versions[mask == 0].tolist()) == {-1}
        expected_logprobs = np.concatenate(
            [np.full(len(ids), -0.5 - n) for n, ids in enumerate(turns)]
        )
        np.testing.assert_allclose(logprobs[mask == 1], expected_logprobs)
        assert not logprobs[mask == 0].any()
        episode = t.task["episode"]
        assert (t.finish_reason, episode["end"], episode["turns"]) == ("stop", "done", 3)
        assert (episode["tool_calls"], episode["tool_errors"], episode["reward"]) == (1, 0, 1.0)
        assert t.task["question"] == QUESTION
        assert "so the answer is 42" in t.response_text and "42" in t.response_text


FAILURES = {
    "hang": "tool hang: timed out after 2s",
    "segfault": "tool segfault: tool process killed by SIGSEGV",
    "big_result": "tool big_result: returned 10485760 bytes, over the 65536-byte cap",
}


def test_a_hanging_crashing_or_flooding_tool_fails_its_episode_and_the_run_goes_on(
    nats_server: EmbeddedNats, topology: Topology, chat_model: tuple[Path, Any]
) -> None:
    tools = [ADD, *(f"{FNS}:{name}" for name in FAILURES)]

    async def main() -> list[TrajectoryEvent]:
        async with episode_worker(
            nats_server.url, topology, chat_model, tools, tool_timeout=2.0
        ) as w:
            for name in FAILURES:
                await w.publish_prompt(name)
            await w.publish_prompt(QUESTION)  # after the failures, an episode that succeeds
            await w.publish_prompt("ramble")  # and one whose last turn hits its token limit
            return await w.trajectories(GROUP * (len(FAILURES) + 2))

    by_question: dict[str, list[TrajectoryEvent]] = {}
    for t in asyncio.run(main()):
        by_question.setdefault(t.task["question"], []).append(t)
    for name, reason in FAILURES.items():
        assert len(by_question[name]) == GROUP
        for t in by_question[name]:
            episode = t.task["episode"]
            assert (t.finish_reason, episode["end"]) == ("error", "failed"), name
            assert episode["reason"] == reason
            assert episode["tool_calls"] == 1 and episode["turns"] == 1
    for t in by_question[QUESTION]:
        assert (t.finish_reason, t.task["episode"]["reward"]) == ("stop", 1.0)
    for t in by_question["ramble"]:  # done by the environment, but its last turn was cut
        assert (t.finish_reason, t.task["episode"]["end"]) == ("length", "done")
