"""A tiny random-init Qwen2 and a character-level tokenizer over the built-in tasks' symbols.

Both are written with `save_pretrained`, so every engine loads them through the real
``AutoTokenizer`` / ``AutoModelForCausalLM.from_pretrained(dir)`` path, exactly as it would
load a hub checkpoint.

Why not a WordLevel tokenizer: transformers 5 loads *every* ``qwen2`` checkpoint with
``Qwen2Tokenizer``, which rebuilds a byte-level BPE from the saved vocabulary and ignores
the saved model type, so a word-level vocabulary would silently lose its multi-character
words. A byte-level BPE with no merges over one-character symbols is what that class
rebuilds exactly, so we build the tokenizer with that class itself: the tokenizer the
workers get from ``AutoTokenizer`` is, token for token, the one we saved (a test checks it).
"""

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM, Qwen2Tokenizer


def build_tokenizer(vocab: Sequence[str]) -> Qwen2Tokenizer:
    """One token per symbol (ids are positions in `vocab`), no ``<bos>``.

    `vocab` holds ``<eos>`` (also the pad token, as in Qwen) and one-character printable
    ASCII symbols (byte-level BPE maps those to themselves). Characters outside it, spaces
    included, are dropped when encoding; decoding joins tokens with no separator.
    """
    return Qwen2Tokenizer(
        vocab={tok: i for i, tok in enumerate(vocab)},
        merges=[],
        eos_token="<eos>",
        pad_token="<eos>",
        # Not a real fallback (the BPE drops unknown characters): naming an existing token
        # stops Qwen2Tokenizer from adding its default "<|endoftext|>" as a 16th token.
        unk_token="<eos>",
    )


def build_tiny_model(
    out_dir: Path,
    vocab: Sequence[str],
    *,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    max_positions: int = 64,
    seed: int = 0,
) -> Path:
    """Writes a random-init Qwen2 causal LM (seeded) and its tokenizer to `out_dir`; returns it.

    Embeddings are tied (as in small Qwen2 checkpoints): one tensor serves as both
    ``model.embed_tokens.weight`` and ``lm_head.weight``, and weight exports carry it once,
    under the first name. The defaults (~120k parameters) are what the built-in task was
    tuned with (see `producers.tasks`).
    """
    tokenizer = build_tokenizer(vocab)
    return save_tiny_qwen2(
        out_dir,
        tokenizer,
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        max_positions=max_positions,
        seed=seed,
    )


def save_tiny_qwen2(
    out_dir: Path,
    tokenizer: Any,
    *,
    hidden: int,
    layers: int,
    heads: int = 4,
    kv_heads: int = 2,
    max_positions: int,
    seed: int,
) -> Path:
    """A random-init Qwen2 over `tokenizer`'s vocabulary (seeded, tied embeddings), written to
    `out_dir` with the tokenizer; returns it. `build_tiny_model` and
    `engines.tiny_chat.build_tiny_chat_model` differ only in the tokenizer."""
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):  # seed the init without touching the caller's RNG
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
