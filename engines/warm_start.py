"""Warm start: supervised fine-tuning on demonstration episodes before RL (`model.warm_start`).

    demonstrations: conversations in OpenAI messages (assistant turns as text or `tool_calls`)
        │  prompt_with_tools + EpisodeTokens: the very tokens and mask the episode runner makes
        ▼
    samples: prompt + response ids [T], mask [T] (1 on model tokens, 0 on prompt, tool, template)
        │  AdamW on the mean negative log-likelihood of the masked tokens, `steps` batches
        ▼
    a Hugging Face directory (model + tokenizer) and warm_start.json (losses, seconds)

Why: RL finds a tool call's format only by luck. The tiny model of the built-in `calc` task
learned the call's first two pieces in 400 RL steps and never a whole call (docs/agents.md);
SmolLM2-135M-Instruct made no call in 32 samples under four prompt styles. The field's recipe
for agentic RL is a cold-start SFT on tool-use demonstrations first (ReTool, and verl's and
AReaL's multi-turn recipes start from SFT checkpoints). Measured here: 300 steps of 32
demonstrations (40 s on one CPU thread) take the tiny model to a well-formed call in 64 of 64
samples.

A demonstration goes through the runner's own code path (`EpisodeTokens`), so the warm start
trains the exact token layout RL will sample and score, chat template and tool format
included: a template that does not render tools gets them in the system message
(`prompt_with_tools`), and calls are written as that message asks (`call_text`).

Knows no bus and no stage: the producer's `prepare` calls it before any worker starts.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from engines.episode import EpisodeTokens
from engines.tools import CALL_CLOSE, CALL_OPEN, prompt_with_tools, template_renders_tools
from schemas.model_config import WARM_START_REPORT

Message = dict[str, Any]


@dataclass
class WarmStartReport:
    steps: int
    samples: int
    """Samples trained on (steps x batch)."""
    loss_start: float
    """Mean masked NLL of the first tenth of the steps."""
    loss_end: float
    """Mean masked NLL of the last tenth of the steps."""
    seconds: float


def call_text(calls: Sequence[dict[str, Any]], listed: bool) -> str:
    """An assistant turn making OpenAI-style `calls` (``{"function": {"name", "arguments"}}``
    or ``{"name", "arguments"}``), in the format `engines.tools.parse_tool_calls` reads: one
    ``<tool_call>{...}</tool_call>`` per call (Qwen2.5's layout), or one JSON list of them when
    `listed` (what `tools_system_prompt` asks of a template that does not render tools)."""
    items = []
    for call in calls:
        function = call.get("function", call)
        arguments = function.get("arguments", {})
        if isinstance(arguments, str):  # OpenAI sends the arguments as a JSON string
            arguments = json.loads(arguments)
        items.append({"name": function["name"], "arguments": arguments})
    if listed:
        return f"{CALL_OPEN}{json.dumps(items)}{CALL_CLOSE}"
    return "".join(f"{CALL_OPEN}{json.dumps(item)}{CALL_CLOSE}" for item in items)


def demonstration_samples(
    tokenizer: Any,
    conversation: Sequence[Message],
    schemas: Sequence[dict[str, Any]],
    max_tokens: int = 4096,
) -> list[tuple[list[int], list[int]]]:
    """`conversation`'s token samples as the episode runner would build them: (ids, mask) per
    sample, ids = prompt + response, mask 1 on the assistant turns' tokens (their end of turn
    included). A render that stops extending the tokens starts a new sample, as in an episode.
    """
    first = next((i for i, m in enumerate(conversation) if m["role"] == "assistant"), None)
    if first is None:
        raise ValueError("a demonstration has no assistant turn")
    messages, template_tools = prompt_with_tools(tokenizer, conversation[:first], schemas)
    listed = bool(schemas) and not template_renders_tools(tokenizer, schemas)
    n_turns = sum(m["role"] == "assistant" for m in conversation)
    episode = EpisodeTokens(
        tokenizer, messages, tools=template_tools, max_turns=n_turns, max_tokens=max_tokens
    )
    eos = tokenizer.eos_token_id
    pending: list[Message] = []
    for message in conversation[first:]:
        if message["role"] != "assistant":
            pending.append(dict(message))
            continue
        if pending and not episode.add_environment(pending):
            break  # a budget ended it: the samples so far are kept
        pending = []
        text = message.get("content") or ""
        if message.get("tool_calls"):
            text += call_text(message["tool_calls"], listed)
        ids = [*tokenizer.encode(text, add_special_tokens=False), eos]
        episode.add_model_turn(ids, [0.0] * len(ids), 0)
    samples = episode.samples if episode.finished else episode.finish("done")
    return [
        (
            [*s.prompt_ids.tolist(), *s.response_ids.tolist()],
            [0] * len(s.prompt_ids) + s.response_mask.tolist(),
        )
        for s in samples
    ]


def masked_nll(model: Any, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean negative log-likelihood of the tokens where `mask` is 1. ids, mask [B, T]."""
    logits = model(input_ids=ids).logits[:, :-1]  # [B, T-1, V]
    nll = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.size(-1)).float(), ids[:, 1:].reshape(-1), reduction="none"
    ).view(ids.size(0), -1)  # [B, T-1]: token t+1 predicted from tokens <= t
    target = mask[:, 1:].float()
    return (nll * target).sum() / target.sum().clamp(min=1.0)


def warm_start(
    source: Path,
    out: Path,
    conversations: Iterator[Sequence[Message]],
    schemas: Sequence[dict[str, Any]],
    *,
    steps: int,
    lr: float,
    batch: int,
    seed: int = 0,
    progress: Callable[[str], None] = print,
) -> WarmStartReport:
    """Fine-tune the model at `source` on `conversations` (drawn as needed, `batch` samples a
    step) and save it with its tokenizer to `out` (may be `source`); `WARM_START_REPORT` is
    written last."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(source)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    pool: list[tuple[list[int], list[int]]] = []
    losses: list[float] = []
    started = time.monotonic()
    shown = 0.0
    rng = random.Random(seed)
    for step in range(steps):
        rows = []
        for _ in range(batch):
            if not pool:
                pool.extend(demonstration_samples(tokenizer, next(conversations), schemas))
                rng.shuffle(pool)
            rows.append(pool.pop())
        width = max(len(ids) for ids, _ in rows)
        # Right padding: the pad positions are masked out of the loss and come after every
        # real token, so causal attention never lets a real token see them.
        ids = torch.tensor([r + [pad] * (width - len(r)) for r, _ in rows])  # [B, T]
        mask = torch.tensor([m + [0] * (width - len(m)) for _, m in rows])  # [B, T]
        loss = masked_nll(model, ids, mask)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        elapsed = time.monotonic() - started
        # Every 50 steps, and every 10 s where steps are slow (a pretrained model on a CPU).
        if step % 50 == 0 or step == steps - 1 or elapsed - shown >= 10.0:
            shown = elapsed
            progress(f"warm start: step {step + 1}/{steps}  loss {losses[-1]:.3f}  {elapsed:.0f}s")
    tenth = max(1, steps // 10)
    report = WarmStartReport(
        steps=steps,
        samples=steps * batch,
        loss_start=sum(losses[:tenth]) / tenth,
        loss_end=sum(losses[-tenth:]) / tenth,
        seconds=round(time.monotonic() - started, 1),
    )
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / WARM_START_REPORT).write_text(json.dumps(asdict(report), indent=2) + "\n")
    return report
