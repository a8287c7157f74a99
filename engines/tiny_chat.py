"""A tiny random-init Qwen2 with a character-level CHAT tokenizer, for the built-in agent task.

Like `engines.tiny` (same reasons: transformers 5 rebuilds every ``qwen2`` tokenizer as
``Qwen2Tokenizer``, a byte-level BPE, so the tokenizer is built with that class and no merges),
plus what a multi-turn episode needs:

- one token per printable ASCII character (byte-level BPE writes ``' '`` as ``Ġ`` and
  ``'\\n'`` as ``Ċ`` in the vocabulary);
- ONE special token, ``<|im_end|>`` (eos AND pad): a special token the policy could emit is
  one `decode(skip_special_tokens=True)` hides, a loophole RL finds (see `producers.tasks`).
  So ``<|im_start|>``, special in Qwen's tokenizers, is an added token here: a first run with
  it special had the random policy emit it mid-turn, invisible to the reward, which could
  then pad a turn with it instead of learning to stop;
- ADDED, non-special tokens (kept by that decode, so the reward and the tool-call parser read
  them): ``<|im_start|>``, the tool tags, and `CALL_HEAD` / `CALL_TAIL`, the two fixed pieces
  of a calculator
  call, so that ``<tool_call>{"name": "calculator", "arguments": {"expression": "23*47"}}
  </tool_call>`` is 10 tokens (4 fixed ones around the 5 characters of the expression, and the
  end of turn) instead of 80 characters a random-init model would have to find one by one;
- a short ChatML template (`CHAT_TEMPLATE`): tools shown as one system line naming them
  (``tools: calculator``: the tiny model learns the call format from the reward, not from a
  schema it cannot read), tool results as a user turn of ``<tool_response>`` blocks, as
  Qwen2.5's template does, and the generation prompt.

The constants are importable without torch (the reward, `producers.agent_tasks`, splits a
response into these pieces); torch and transformers are imported by the builders only.
"""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

IM_START, IM_END = "<|im_start|>", "<|im_end|>"
CALL_HEAD = '{"name": "calculator", "arguments": {"expression": "'
CALL_TAIL = '"}}'
ADDED_TOKENS: tuple[str, ...] = (
    IM_START,
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    CALL_HEAD,
    CALL_TAIL,
)
"""Added, not special: `decode(skip_special_tokens=True)` keeps them."""
# Byte-level BPE's names for the two printable whitespace characters.
BYTE_LEVEL = {" ": "\u0120", "\n": "\u010a"}
CHARACTERS: tuple[str, ...] = tuple(c for c in string.printable if c not in "\t\r\x0b\x0c")
"""The 95 printable ASCII characters and the newline, one token each."""

CHAT_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\ntools: ' }}"
    "{% for tool in tools %}{{ tool.function.name }}{% if not loop.last %}{{ ', ' }}{% endif %}"
    "{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}"
    "{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}"
    "{{ '<|im_end|>\\n' }}{% endif %}"
    "{% else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML, compact: the tools named on one system line; a tool result a user turn of
``<tool_response>`` blocks (consecutive results share one turn)."""


def build_chat_tokenizer() -> Any:
    """The character-level chat tokenizer (a ``Qwen2Tokenizer``): id 0 ``<|im_end|>``, then one
    per character, then the added tokens."""
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    vocab = [IM_END, *(BYTE_LEVEL.get(c, c) for c in CHARACTERS)]
    tokenizer = Qwen2Tokenizer(
        vocab={token: i for i, token in enumerate(vocab)},
        merges=[],
        eos_token=IM_END,
        pad_token=IM_END,
        # Naming an existing token stops Qwen2Tokenizer adding "<|endoftext|>" (engines.tiny).
        unk_token=IM_END,
        bos_token=None,
    )
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED_TOKENS])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_tiny_chat_model(
    out_dir: Path,
    *,
    hidden: int = 64,
    layers: int = 2,
    seed: int = 0,
    max_positions: int = 256,
) -> Path:
    """Writes a random-init Qwen2 (seeded, tied embeddings, as `engines.tiny`) and the chat
    tokenizer to `out_dir`; returns it."""
    from engines.tiny import save_tiny_qwen2  # torch and transformers: imported on use

    return save_tiny_qwen2(
        out_dir,
        build_chat_tokenizer(),
        hidden=hidden,
        layers=layers,
        max_positions=max_positions,
        seed=seed,
    )
