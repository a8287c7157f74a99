"""The warm start (`engines.warm_start`, `model.warm_start`): SFT on demonstration episodes in
the episode runner's own tokens, before RL.

- A demonstration's tokens are the whole conversation rendered once (two template styles, the
  call written in the format each asks for), and its mask is 1 on exactly the assistant turns.
- The loss ignores everything the mask leaves out: changing the tool's result leaves it equal.
- The built-in calc demonstrations teach the format: after a short warm start the tiny model's
  greedy first turn is a well-formed calculator call.
- Config: a warm start with no demonstrations to draw is refused on load, in one line; the
  producer's `prepare` runs it once, and a resumed run finds it done.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from engines.tiny_chat import build_chat_tokenizer, build_tiny_chat_model
from engines.tools import load_tool, parse_tool_calls, prompt_with_tools
from engines.warm_start import call_text, demonstration_samples, masked_nll, warm_start
from producers import agent_tasks
from producers.launcher import WarmStartFailed, prepare
from schemas.config import ConfigError, parse_config
from schemas.model_config import WARM_START_REPORT
from tests.chat_templates import CHATML_TOOLS, chat_tokenizer, smollm2_template
from tests.episode_script import build_chat_model

ADD = load_tool("tests.agent_tools:add").schema
CALCULATOR = load_tool("producers.agent_tools:calculator").schema
DEMO: list[dict[str, Any]] = [
    {"role": "user", "content": "What is 17 plus 25?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"function": {"name": "add", "arguments": '{"a": 17, "b": 25}'}}],
    },
    {"role": "tool", "name": "add", "content": "42"},
    {"role": "assistant", "content": "42"},
]


def rendered_once(tokenizer: Any, conversation: list[dict[str, Any]]) -> list[int]:
    """The conversation through the template in one go, the assistant calls as text."""
    return list(
        tokenizer.apply_chat_template(
            conversation,
            tokenize=True,
            return_dict=False,
            tools=[ADD] if tokenizer.chat_template == CHATML_TOOLS else None,
        )
    )


@pytest.mark.parametrize(
    ("template", "listed"), [(CHATML_TOOLS, False), (smollm2_template(), True)]
)
def test_a_demonstration_is_the_conversation_rendered_once_with_the_assistant_turns_masked(
    template: str, listed: bool
) -> None:
    tokenizer = chat_tokenizer(template)
    [(ids, mask)] = demonstration_samples(tokenizer, DEMO, [ADD])
    call = call_text(DEMO[1]["tool_calls"], listed)
    assert parse_tool_calls(call).calls[0].arguments == {"a": 17, "b": 25}
    assert call.startswith("<tool_call>[") == listed  # the format the system message asks for
    messages, _ = prompt_with_tools(tokenizer, DEMO[:1], [ADD])
    as_text = [*messages, {"role": "assistant", "content": call}, DEMO[2], DEMO[3]]
    whole = rendered_once(tokenizer, as_text)
    eos = tokenizer.eos_token_id
    # The last turn ends at its end-of-turn token: what follows it is the template's newline.
    end = len(whole) - whole[::-1].index(eos)
    assert ids == whole[:end]
    # Mask 1 on exactly the two assistant turns' tokens and their ends of turn.
    model_tokens = [
        t for text in (call, "42") for t in [*tokenizer.encode(text, add_special_tokens=False), eos]
    ]
    assert [t for t, m in zip(ids, mask, strict=True) if m] == model_tokens
    assert mask[-1] == 1 and sum(mask) == len(model_tokens)


def test_the_loss_ignores_what_the_mask_leaves_out(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    model_dir, tokenizer = build_chat_model(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    other = [*DEMO[:2], {**DEMO[2], "content": "41"}, DEMO[3]]
    [(a, mask_a)], [(b, mask_b)] = (
        demonstration_samples(tokenizer, d, [ADD]) for d in (DEMO, other)
    )
    # Up to the tool's result the two are the same; its tokens are targets the mask leaves out.
    changed_at = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y)
    assert mask_a[changed_at] == 0 and mask_a[:changed_at] == mask_b[:changed_at]
    first_a, first_b = (
        [m if i < changed_at else 0 for i, m in enumerate(k)] for k in (mask_a, mask_b)
    )
    assert 0 < sum(first_a) < sum(mask_a)
    assert torch.equal(
        masked_nll(model, torch.tensor([a]), torch.tensor([first_a])),
        masked_nll(model, torch.tensor([b]), torch.tensor([first_b])),
    )


@pytest.mark.timeout(300)
def test_the_calc_demonstrations_teach_the_tiny_model_the_call(tmp_path: Path) -> None:
    model_dir = build_tiny_chat_model(tmp_path / "model")
    demos = (agent_tasks.demonstration(i) for i in range(10**6))
    lines: list[str] = []
    report = warm_start(
        model_dir,
        model_dir,
        demos,
        [CALCULATOR],
        steps=150,
        lr=3e-3,
        batch=16,
        progress=lines.append,
    )
    assert report.loss_end < 0.5 * report.loss_start, report
    assert json.loads((model_dir / WARM_START_REPORT).read_text())["steps"] == 150
    assert lines and lines[-1].startswith("warm start: step 150/150")
    from transformers import AutoModelForCausalLM

    tokenizer = build_chat_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    record = agent_tasks.task_record("calc", 7, seed=5)
    messages, tools = prompt_with_tools(tokenizer, record["messages"], [CALCULATOR])
    prompt = tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    out = model.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=16, eos_token_id=0, pad_token_id=0
    )
    turn = tokenizer.decode(out[0, len(prompt) :], skip_special_tokens=True)
    assert agent_tasks.called(turn), turn
    assert parse_tool_calls(turn).calls[0].name == "calculator"


def test_a_warm_start_without_demonstrations_is_refused_on_load() -> None:
    with pytest.raises(ConfigError) as refused:
        parse_config({"model": {"warm_start": {"steps": 10}}})  # the digits task: none built in
    assert "model.warm_start.dataset: none given" in str(refused.value)
    assert "\n" not in str(refused.value)
    with pytest.raises(ConfigError, match="model.warm_start.stepz"):
        parse_config({"model": {"warm_start": {"stepz": 10}}})


def test_prepare_warm_starts_once_and_a_resumed_run_finds_it_done(tmp_path: Path) -> None:
    cfg = parse_config(
        {
            "data": {"task": "calc", "reward": "producers.agent_tasks:score_calc"},
            "agent": {"tools": ["producers.agent_tools:calculator"]},
            "model": {"warm_start": {"steps": 3, "batch": 4}},
        }
    )
    prepared = prepare(cfg, tmp_path)
    model_dir = tmp_path / "model"
    assert prepared.model.path == str(model_dir.resolve())
    report = model_dir / WARM_START_REPORT
    first = report.stat().st_mtime_ns
    weights = (model_dir / "model.safetensors").read_bytes()
    built = tmp_path / "built"
    build_tiny_chat_model(built)  # the random init it started from
    assert (built / "model.safetensors").read_bytes() != weights  # it trained
    again = prepare(prepared, tmp_path)  # a resumed run: the stored config, the same directory
    assert again.model.path == prepared.model.path
    assert report.stat().st_mtime_ns == first
    assert (model_dir / "model.safetensors").read_bytes() == weights


def test_a_bad_demonstration_stops_the_run_in_one_line(tmp_path: Path) -> None:
    demos = tmp_path / "demos.jsonl"
    bad_call = {**DEMO[1], "tool_calls": [{"function": {"name": "add", "arguments": "{a: 1"}}]}
    demos.write_text(json.dumps({"messages": [DEMO[0], bad_call, DEMO[2], DEMO[3]]}) + "\n")
    cfg = parse_config(
        {
            "data": {"task": "calc", "reward": "producers.agent_tasks:score_calc"},
            "agent": {"tools": ["tests.agent_tools:add"]},
            "model": {"warm_start": {"steps": 2, "batch": 2, "dataset": str(demos)}},
        }
    )
    with pytest.raises(WarmStartFailed) as failed:
        prepare(cfg, tmp_path / "run")
    message = str(failed.value)
    assert message.startswith("model.warm_start: JSONDecodeError: ") and "\n" not in message
    assert not (tmp_path / "run" / "model" / WARM_START_REPORT).exists()
