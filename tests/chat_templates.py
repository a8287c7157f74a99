"""Chat tokenizers for the episode tests, built here (nothing downloaded): a byte-level BPE
with ChatML's special tokens, and three chat templates to put on it.

- `CHATML_TOOLS`: ChatML in the style of Qwen2/2.5's template (written here, not copied): the
  tools' schemas in the system turn, calls as ``<tool_call>{json}</tool_call>`` text, tool
  results as a user turn of ``<tool_response>`` blocks (consecutive tool messages share one).
- `CHATML_STRIPS_THINKING`: plain ChatML that drops ``<think>...</think>`` from every
  assistant turn but the last, as reasoning templates (Qwen3's) do.
- `smollm2_template()`: SmolLM2-135M-Instruct's own template, from the copy in
  tests/golden/smollm2_chat_template.json (its source and licence are in that file).

The BPE is trained on `TEXTS`, so words of the test conversations are merged tokens (a model
that samples one of them letter by letter samples a tokenisation the tokenizer never makes).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

GOLDEN = Path(__file__).resolve().parent / "golden"
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
ADDED = ["<tool_call>", "</tool_call>", "<think>", "</think>"]
"""Added but not special (as in Qwen2.5's tokenizer): kept by decode(skip_special_tokens)."""
TEXTS = [
    "What is 17 plus 25? Use the calculator.",
    "the calculator says 42, so the answer is 42",
    '{"name": "add", "arguments": {"a": 17, "b": 25}}',
    "You are a helpful assistant. You may call tools.",
    "Let me think about it: seventeen and twenty five make forty two.",
    "<tool_response> the result is 42 </tool_response>",
]

CHATML_TOOLS = (
    "{% if tools %}{{ '<|im_start|>system\\n' }}"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}"
    "{% else %}{{ 'You are a helpful assistant.' }}{% endif %}"
    "{{ '\\n\\n# Tools\\n\\nYou may call tools. Their signatures are within <tools></tools>:"
    "\\n<tools>\\n' }}{% for tool in tools %}{{ tool | tojson }}{{ '\\n' }}{% endfor %}"
    '{{ \'</tools>\\n\\nTo call one: <tool_call>{"name": <name>, "arguments": <object>}'
    "</tool_call><|im_end|>\\n' }}"
    "{% elif messages[0].role == 'system' %}"
    "{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' and loop.first %}"
    "{% elif m.role == 'tool' %}"
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

CHATML_STRIPS_THINKING = (
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and not loop.last and '</think>' in m.content %}"
    "{% set content = m.content.split('</think>')[-1].lstrip() %}"
    "{% else %}{% set content = m.content %}{% endif %}"
    "{{ '<|im_start|>' + m.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def smollm2_template() -> str:
    """SmolLM2-135M-Instruct's chat template (the golden copy)."""
    doc = json.loads((GOLDEN / "smollm2_chat_template.json").read_text())
    return str(doc["chat_template"])


def train_tokenizer() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TEXTS, trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    return tokenizer


def chat_tokenizer(template: str) -> PreTrainedTokenizerFast:
    """The trained BPE as a transformers tokenizer with `template` as its chat template; its
    eos (the end of a model turn) is ``<|im_end|>``."""
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token="<|im_start|>",
    )
    tokenizer.chat_template = template
    return tokenizer
