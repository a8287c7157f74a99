"""Agent code through the rollout worker's OpenAI-compatible endpoint (`agent.function`).

A real rollout worker (`served_rollout`) over a scripted model (`tests.episode_script`) serves
`tests.agent_tools:two_calls`, an agent written with the real `openai` client: it asks with a
tool, gets a structured `tool_calls` answer, runs the tool, sends its whole history back and
asks again. Each episode is ONE merged sample: its tokens are the conversation rendered once
with the model's turns as sampled, its mask exactly the model's tokens; its reward is what
the agent returned. An agent that edits its history gets a new sample, never a misaligned one.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from transformers import PreTrainedTokenizerFast

from bus.embedded import EmbeddedNats
from bus.topology import PROMPTS, WEIGHTS, Topology
from engines.tools import load_tools
from schemas import TrajectoryEvent, encode
from tests.episode_script import ADD, ASK, SCRIPT, ScriptedEngine, build_chat_model, question
from tests.helpers import store_weights, stored_trajectories
from tests.test_rollout_invariants import served_rollout

pytest.importorskip("openai")  # in the dev extra; the endpoint itself needs no client

GROUP = 2


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, PreTrainedTokenizerFast]:
    return build_chat_model(tmp_path_factory.mktemp("chat"))


def run_agent(url: str, topology: Topology, chat: tuple[Path, Any], function: str) -> list[Any]:
    model_dir, tokenizer = chat

    async def main() -> list[TrajectoryEvent]:
        engine = ScriptedEngine(model_dir, tokenizer)
        sections = {"data": {"n": GROUP}, "agent": {"function": function}}
        async with served_rollout(
            url, topology, model_dir, engine, {}, sections=sections, tokenizer=tokenizer
        ) as (_, js, _, _):
            params = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
            event = await store_weights(js, topology, 0, params)
            await js.publish(topology.subject(WEIGHTS), encode(event))
            prompt = question(topology.run, 0, ASK, GROUP)
            await js.publish(topology.subject(PROMPTS), encode(prompt))

            return await stored_trajectories(js, topology, GROUP)

    return asyncio.run(main())


def test_an_openai_client_agent_of_two_calls_is_one_merged_sample(
    nats_server: EmbeddedNats, topology: Topology, chat_model: tuple[Path, Any]
) -> None:
    tokenizer = chat_model[1]
    trajectories = run_agent(nats_server.url, topology, chat_model, "tests.agent_tools:two_calls")
    turns = SCRIPT[ASK]
    schemas: list[Any] = [tool.schema for tool in load_tools([ADD]).values()]
    conversation = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": turns[0]},  # as sampled, not as `tool_calls` objects
        {"role": "tool", "content": "42"},
        {"role": "assistant", "content": turns[1]},
    ]
    once = tokenizer.apply_chat_template(
        conversation, tools=schemas, tokenize=True, return_dict=False
    )
    assert isinstance(once, list)
    model = [
        [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
        for text in turns
    ]
    assert sorted(t.sample_index for t in trajectories) == list(range(GROUP))
    for t in trajectories:
        episode = t.task["episode"]
        assert (episode["samples"], episode["turns"], episode["tool_calls"]) == (1, 2, 1)
        assert (t.finish_reason, episode["end"], episode["reward"]) == ("stop", "done", 1.0)
        built = [*t.prompt_ids.numpy().tolist(), *t.response_ids.numpy().tolist()]
        assert built == once[: len(built)] and tokenizer.decode(once[len(built) :]) == "\n"
        assert t.response_mask is not None
        mask = t.response_mask.numpy()
        response = t.response_ids.numpy()
        assert response[mask == 1].tolist() == [i for ids in model for i in ids]
        assert mask[: len(model[0])].all() and mask[-len(model[1]) :].all()
        assert not mask[len(model[0]) : -len(model[1])].any()  # the tool result, the header


def test_an_agent_that_rewrites_its_history_gets_a_new_sample_not_a_misaligned_one(
    nats_server: EmbeddedNats, topology: Topology, chat_model: tuple[Path, Any]
) -> None:
    tokenizer = chat_model[1]
    trajectories = run_agent(
        nats_server.url, topology, chat_model, "tests.agent_tools:edits_history"
    )
    schemas: list[Any] = [tool.schema for tool in load_tools([ADD]).values()]
    edited = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": "I asked the calculator."},
        {"role": "tool", "content": "42"},
    ]
    prompt = tokenizer.apply_chat_template(
        edited, tools=schemas, tokenize=True, return_dict=False, add_generation_prompt=True
    )
    second = [*tokenizer.encode(SCRIPT[ASK][1], add_special_tokens=False), tokenizer.eos_token_id]
    for t in trajectories:
        episode = t.task["episode"]
        assert (episode["samples"], episode["turns"], episode["reward"]) == (2, 2, 1.0)
        # The last sample starts from the edited history and holds the second turn.
        assert t.prompt_ids.numpy().tolist() == prompt
        assert t.response_ids.numpy().tolist() == second
        assert t.response_mask is not None and t.response_mask.numpy().all()
        # The first call's sample is kept and trained: the question rendered, the first turn.
        assert len(t.earlier) == 1, f"{len(t.earlier)} earlier segments"
        first = t.earlier[0]
        question = [{"role": "user", "content": ASK}]
        assert first.prompt_ids.numpy().tolist() == tokenizer.apply_chat_template(
            question, tools=schemas, tokenize=True, return_dict=False, add_generation_prompt=True
        )
        assert first.response_ids.numpy().tolist() == [
            *tokenizer.encode(SCRIPT[ASK][0], add_special_tokens=False),
            tokenizer.eos_token_id,
        ]
