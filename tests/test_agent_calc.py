"""The built-in agent task `calc` (producers.agent_tasks, producers.agent_tools) and its tiny chat
model (engines.tiny_chat), without a run:

- the chat tokenizer reloads from its directory as it was built (template, added tokens, one
  special token), a calculator call is 10 tokens, and an episode with a call built turn by
  turn equals the conversation rendered once; the call parses as the calculator's;
- the calculator evaluates NUMBER OP NUMBER and refuses anything else;
- the reward: full only for the asked expression's call AND its copied result; the copy of
  the tool's result credited after any call, recomputed, not read from the text;
- the config: calc needs an agent section, unknown tasks are refused on load, the example
  loads, and its prompts are chat messages;
- a step's episode figures (tool-use rate, mean turns) from its samples.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgpack
import pytest
from transformers import AutoTokenizer

from consumers.buffer_groups import episode_stats
from engines.episode import EpisodeTokens
from engines.tiny_chat import ADDED_TOKENS, CHAT_TEMPLATE, IM_END, build_tiny_chat_model
from engines.tools import load_tool, parse_tool_calls, prompt_with_tools, template_renders_tools
from producers import agent_tasks, tasks
from producers.agent_tasks import ideal_call, score_calc, score_calc_text, task_record
from producers.agent_tools import calculator
from producers.datasets import records
from schemas import BatchEvent, DecodeError, RewardEvent, decode
from schemas.config import (
    AGENT_TASKS,
    BUILT_IN_TASKS,
    ConfigError,
    RunConfig,
    load_config,
    validate,
)
from schemas.overrides import read_yaml
from tests.golden_events import GOLDEN
from tests.helpers import trajectory

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "agent_calc.yaml"
CALCULATOR = load_tool("producers.agent_tools:calculator").schema
TASK = {"name": "calc", "expression": "57*83", "answer": "4731"}
CALL = ideal_call("57*83")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The chat tokenizer as every worker gets it: reloaded from the model directory."""
    out = build_tiny_chat_model(tmp_path_factory.mktemp("calc") / "model", hidden=16, layers=1)
    return AutoTokenizer.from_pretrained(out)


def test_the_chat_tokenizer_reloads_as_built(tokenizer: Any) -> None:
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert tokenizer.eos_token == tokenizer.pad_token == IM_END
    assert tokenizer.all_special_tokens == [IM_END]
    added = tokenizer.get_added_vocab()
    assert set(ADDED_TOKENS) <= set(added) and len(tokenizer) == 104
    # Only the end of turn is hidden from the reward's text: nothing else the policy could hide.
    for token in [*ADDED_TOKENS, IM_END]:
        shown = tokenizer.decode(tokenizer.convert_tokens_to_ids([token]), skip_special_tokens=True)
        assert shown == ("" if token == IM_END else token)
    ids = tokenizer.encode(CALL, add_special_tokens=False)
    assert len(ids) == 9  # + the end of turn: a call is 10 tokens
    assert tokenizer.decode(ids, skip_special_tokens=True) == CALL
    text = "Any printable text: ~`{}[]\n\t-- kept"  # the tab is no token: dropped
    assert tokenizer.decode(tokenizer.encode(text)) == text.replace("\t", "")


def test_an_episode_with_a_call_is_the_conversation_rendered_once(tokenizer: Any) -> None:
    assert template_renders_tools(tokenizer, [CALCULATOR])
    messages, tools = prompt_with_tools(tokenizer, task_record("calc", 0)["messages"], [CALCULATOR])
    assert tools == [CALCULATOR]
    episode = EpisodeTokens(tokenizer, messages, tools=tools, max_turns=3, max_tokens=256)
    conversation = list(messages)
    prompt = task_record("calc", 0)["task"]
    turns = [ideal_call(prompt["expression"]), prompt["answer"]]
    result = {"role": "tool", "name": "calculator", "content": calculator(prompt["expression"])}
    for n, text in enumerate(turns):
        ids = [*tokenizer.encode(text, add_special_tokens=False), tokenizer.eos_token_id]
        said = episode.add_model_turn(ids, [-0.5] * len(ids), [3] * len(ids))
        conversation.append({"role": "assistant", "content": text})
        if n == 0:
            parsed = parse_tool_calls(said)
            assert [(c.name, c.arguments) for c in parsed.calls] == [
                ("calculator", {"expression": prompt["expression"]})
            ]
            assert episode.add_environment([result])
            conversation.append(result)
    episode.finish("done")
    assert len(episode.samples) == 1, [(s.end, s.reason) for s in episode.samples]
    [sample] = episode.samples
    newline = tokenizer.encode("\n", add_special_tokens=False)
    once = tokenizer.apply_chat_template(
        conversation, tools=tools, tokenize=True, return_dict=False
    )
    # The whole conversation ends with the template's newline after the last end of turn.
    assert [*sample.prompt_ids, *sample.response_ids, *newline] == list(once)
    assert int(sample.response_mask.sum()) == 10 + 5  # the call and the answer, each + eos
    text = tokenizer.decode(sample.response_ids.tolist(), skip_special_tokens=True)
    assert score_calc(text, prompt) == 1.0


@pytest.mark.parametrize(
    ("expression", "result"),
    [("23*47", "1081"), ("5+7", "12"), ("10-20", "-10"), ("0*99", "0")],
)
def test_the_calculator_evaluates_one_operation(expression: str, result: str) -> None:
    assert calculator(expression) == result


@pytest.mark.parametrize(
    "expression", ["2**3", "__import__('os')", "1/2", " 1*2", "", "1*2*3", "9" * 13 + "*2"]
)
def test_the_calculator_refuses_anything_else(expression: str) -> None:
    with pytest.raises(ValueError, match="is not NUMBER OP NUMBER"):
        calculator(expression)


def episode_text(first: str, result: str | None = None, answer: str = "") -> str:
    """An episode's response text as the rollout decodes it (special tokens skipped)."""
    if result is None:
        return first
    return (
        f"{first}\n<|im_start|>user\n<tool_response>\n{result}\n</tool_response>\n"
        f"<|im_start|>assistant\n{answer}"
    )


@pytest.mark.parametrize(
    ("text", "reward"),
    [
        # 0.1 x the call's shape + 0.6 x the asked expression in it + 0.3 x the answer's copy
        # of the tool's result, after any well-formed call.
        (episode_text(CALL, "4731", "4731"), 1.0),
        # A right guess without a call (the model cannot multiply): nothing.
        (episode_text("4731"), 0.0),
        # A malformed call, answered with the parser's reason: the answer counts for nothing.
        (episode_text(CALL.removesuffix("</tool_call>"), "error: ...", "4731"), 0.1 * 8 / 9 + 0.6),
        (episode_text(""), 0.0),
        (episode_text(CALL, "4731", "4700"), 0.7 + 0.3 * 0.5),  # right call, wrong answer
        (episode_text(CALL, "4731", "47311"), 0.7 + 0.3 * 4 / 5),  # past the answer: costs
        # Wrong operands: the expression's characters in place, and the answer's copy of the
        # tool's result (the copy is learnable from every call); the product, which the model
        # cannot compute, earns nothing as the answer of another expression's call.
        (episode_text(ideal_call("57*38"), "2166", "2166"), 0.1 + 0.6 * 3 / 5 + 0.3),
        (episode_text(ideal_call("57*38"), "2166", "4731"), 0.1 + 0.6 * 3 / 5),
        (episode_text(ideal_call("57*38"), "2166", "2100"), 0.1 + 0.6 * 3 / 5 + 0.3 * 2 / 4),
        (episode_text(ideal_call("57+83"), "140", "140"), 0.1 + 0.6 * 4 / 5 + 0.3),  # wrong op
        # The calculator refuses 57*8x: no result to copy.
        (episode_text(ideal_call("57*8x"), "error: ...", ""), 0.1 * 6 / 9 + 0.6 * 4 / 5),
        (episode_text(ideal_call("57*8x"), "error: ...", "error: ..."), 0.1 * 6 / 9 + 0.48),
        # The copied result is the calculator's on the call, recomputed: a tool response the
        # model writes itself in its answer turn earns nothing.
        (episode_text(CALL, "4731", "</tool_response>\n12"), 0.7),
        (episode_text(ideal_call("57*38"), "2166", "<tool_response>12</tool_response>12"), 0.46),
        # Two calls in the first turn: no one result to copy.
        (episode_text(CALL + CALL, "4731\n4731", "4731"), 0.1 * 9 / 18 + 0.6),
        # The expression's length is the model's: a longer one costs (in the shape once the
        # call is whole, and in the expression), a shorter one earns for the characters it has.
        (episode_text(ideal_call("57*8333"), "474981", ""), 0.1 * 9 / 11 + 0.6 * 5 / 7),
        (episode_text(ideal_call("57*8"), "456", "456"), 0.1 * 8 / 9 + 0.6 * 4 / 5 + 0.3),
        # The call's credit ends at the first unit out of place: text after it earns nothing.
        (episode_text('<tool_call>"}}"}}"}}"}}"}}"}}"}}"}}'), 0.1 / 9),
        (episode_text(CALL + "x", "4731", "4731"), 0.1 * 9 / 10 + 0.9),  # past the call: costs
        (episode_text("<tool_call>", "error: a <tool_call> without its </tool_call>"), 0.1 / 9),
    ],
)
def test_the_reward_is_full_only_for_the_call_and_the_copied_result(
    text: str, reward: float
) -> None:
    assert score_calc(text, TASK) == pytest.approx(reward)


def test_calc_needs_an_agent_section_and_task_names_are_checked_on_load() -> None:
    cfg = load_config(EXAMPLE)
    assert cfg.data.task == "calc" and cfg.agent is not None
    assert cfg.agent.tools == ["producers.agent_tools:calculator"]
    data = read_yaml(EXAMPLE)
    assert isinstance(data, dict)
    with pytest.raises(ConfigError, match="^x.yaml: data.task calc .* needs an agent section"):
        validate(RunConfig, {**data, "agent": None}, "x.yaml")
    with pytest.raises(ConfigError, match=r"^x.yaml: data.task: unknown built-in task 'calcs'"):
        validate(RunConfig, {**data, "data": {**data["data"], "task": "calcs"}}, "x.yaml")
    # With a dataset the task is ignored: its rows are the prompts.
    RunConfig.model_validate({"data": {"task": "calc", "dataset": "rows.jsonl"}})
    assert set(BUILT_IN_TASKS) == set(tasks.TASKS) and set(AGENT_TASKS) == set(agent_tasks.TASKS)


def test_calc_prompts_are_chat_messages_of_fixed_length() -> None:
    cfg = load_config(EXAMPLE)
    for _, (_, _, record) in zip(range(200), records(cfg.data, 0), strict=False):
        [message] = record["messages"]
        a, b = message["content"].split("*")
        assert record["prompt"] is None and message["role"] == "user"
        assert 32 <= int(a) <= 99 and 32 <= int(b) <= 99
        assert record["task"]["answer"] == calculator(message["content"])
        assert len(record["task"]["answer"]) == 4
    assert task_record("calc", 7, seed=1) == task_record("calc", 7, seed=1)


def test_a_steps_episode_figures() -> None:
    def scored(tool_calls: int | None, turns: int, reward: float = 0.0) -> RewardEvent:
        t = trajectory("calc")
        if tool_calls is not None:
            episode = {"tool_calls": tool_calls, "turns": turns}
            t = t.model_copy(update={"task": {**t.task, "episode": episode}})
        return RewardEvent(id=t.id, run="calc", trajectory=t, reward=reward)

    step = [scored(1, 2, 1.0), scored(0, 1), scored(2, 3, 0.7), scored(0, 1)]
    assert episode_stats(step) == {"tool_use_rate": 0.5, "turns_mean": 1.75, "solved_rate": 0.25}
    assert episode_stats([scored(None, 1), scored(None, 1)]) == {}  # single-turn samples
    assert episode_stats([]) == {}


def test_batch_events_carry_the_solved_rate_and_older_ones_read_as_having_none() -> None:
    batch = decode((GOLDEN / "batch.v3.msgpack").read_bytes(), BatchEvent)
    assert (batch.tool_use_rate, batch.turns_mean, batch.solved_rate) == (0.5, 1.5, 0.25)
    old = decode((GOLDEN / "batch.v2.msgpack").read_bytes(), BatchEvent)
    assert (old.schema_version, old.solved_rate) == (3, None)
    v2 = msgpack.unpackb((GOLDEN / "batch.v2.msgpack").read_bytes())
    with pytest.raises(DecodeError, match="schema_version 2 has no solved_rate"):
        decode(msgpack.packb({**v2, "solved_rate": 0.25}))


def test_the_text_reward_of_a_real_chat_model_needs_the_call_and_the_copied_answer() -> None:
    task = {"expression": "57*83", "answer": "4731"}
    call = '<tool_call>[{"name": "calculator", "arguments": {"expression": "57*83"}}]</tool_call>'
    tool = "\ntool\n4731\nassistant\n"  # SmolLM2's tool turn, special tokens skipped
    assert score_calc_text(f"{call}{tool}The answer is 4731", task) == 1.0
    assert score_calc_text(f"{call}{tool}Done.", task) == 0.5  # the tool's 4731 is not its answer
    assert score_calc_text("57*83 = 4700", task) == 0.25  # no call; two digits in place
    wrong = call.replace("57*83", "57*38")
    assert score_calc_text(f"{wrong}\ntool\n2166\nassistant\n4731", task) == 0.5
    assert score_calc_text("no idea", task) == 0.0


def test_the_bench_reads_exact_calls_first_digits_and_copies_from_the_samples(
    tmp_path: Path,
) -> None:
    from ops.bench.agent import episode_shares

    def response(expression: str, result: str, answer: str) -> dict[str, Any]:
        """As samples.jsonl writes an episode: decoded with the end of turn kept."""
        tool = f"<|im_start|>user\n<tool_response>\n{result}\n</tool_response>{IM_END}"
        text = f"{ideal_call(expression)}{IM_END}\n{tool}\n<|im_start|>assistant\n{answer}"
        return {"text": text + IM_END, "reward": 0.0}

    prompt = "<|im_start|>system\ntools: calculator<|im_end|>\n<|im_start|>user\n57*83<|im_end|>"
    responses = [
        response("57*83", "4731", "4731"),  # exact, first digit, copied
        response("53*83", "4399", "4390"),  # first digit, not copied
        response("75*83", "6225", "6225"),  # copied
        {"text": "4731" + IM_END, "reward": 0.0},  # no call: none of them, no result to copy
    ]
    groups = [
        {"step": 3, "prompt": prompt, "responses": responses},
        {"step": None, "prompt": prompt, "responses": responses},  # not trained: not counted
    ]
    path = tmp_path / "samples.jsonl"
    path.write_text("".join(json.dumps(g) + "\n" for g in groups))
    assert episode_shares(path) == [
        {"step": 3, "exact_call": 0.25, "first_digit": 0.5, "copy": 2 / 3}
    ]
