"""A `.gguf` model.path, end to end, on a tiny random llama written as GGUF here (no download).

`tests/test_gguf.py` checks the conversion on the real SmolLM2 GGUF, which CI does not install;
this file is the GGUF test CI runs (the `gguf` package is in the `dev` extra). It writes what
llama.cpp's `convert_hf_to_gguf.py` writes for a llama, with the `gguf` package's own writer:

    random LlamaForCausalLM (2 layers, hidden 64, 4 heads, 2 kv heads, tied embeddings,
    non-default rope theta and norm eps) + a byte-level BPE tokenizer trained on a few strings
    + a ChatML chat template
    -> GGUFWriter: llama.* metadata, tokenizer.ggml.* fields, tensors under llama.cpp's names,
       q/k rows permuted as llama.cpp permutes them, all F32 but one Q8_0 tensor
    -> `resolve_model_path(file)` (the hook every worker goes through) converts it

and checks that the converted directory is the same model: every tensor equal to the original's
(the Q8_0 one equal to the `gguf` package's dequantisation of what was written), the same logits
from a plain `from_pretrained` (no accelerate), the same token ids from its tokenizer, the chat
template kept, and a second resolve converting nothing. A few seconds on a CPU.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

import engines.gguf
from engines.gguf import SOURCE_FILE
from engines.model_source import resolve_model_path
from producers.samples import load_decoder
from schemas.config import ModelConfig, RunConfig

LAYERS = 2
HEADS = 4
KV_HEADS = 2
ROPE_THETA = 5000.0
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEXTS = [
    "the cat sat on the mat",
    "hello world, hello there",
    "What is the capital of France? Paris.",
    "numbers 12345 and symbols !?",
]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
Q8_0_TENSOR = "model.layers.1.mlp.down_proj.weight"
"""The one tensor written as Q8_0 (its rows, 128 wide, are whole blocks of 32)."""

GGUF_NAMES = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
"""Hugging Face module names -> llama.cpp tensor names (per layer: `blk.N.` before them)."""


@dataclass(frozen=True)
class Tiny:
    file: Path
    reference: dict[str, torch.Tensor]
    """The original weights as the converted model must hold them (Q8_0 one dequantised)."""
    tokenizer: Tokenizer
    cache: Path
    converted: Path


def gguf_name(hf_name: str) -> str:
    module, suffix = hf_name.rsplit(".", 1)
    if module in GGUF_NAMES:
        return f"{GGUF_NAMES[module]}.{suffix}"
    _, _, layer, rest = module.split(".", 3)
    return f"blk.{layer}.{GGUF_NAMES[rest]}.{suffix}"


def llama_cpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """q/k rows in llama.cpp's rotary layout (`LlamaModel.permute` of convert_hf_to_gguf.py)."""
    rows = weights.shape[0]
    return (
        weights.reshape(heads, 2, rows // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def train_tokenizer() -> Tokenizer:
    """A byte-level BPE (what `tokenizer.ggml.model = gpt2` describes): the 256 byte symbols,
    the specials, and some merges learnt from `TEXTS`."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(TEXTS, trainer)
    return tokenizer


def tiny_model(vocab_size: int) -> LlamaForCausalLM:
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": ROPE_THETA},
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # weights large enough that every one of them moves the logits
        for name, param in model.named_parameters():
            scale = 0.3 if "norm" in name else 0.15
            param.copy_((1.0 if "norm" in name else 0.0) + scale * torch.randn_like(param))
    return model


def write_gguf(
    path: Path, model: LlamaForCausalLM, tokenizer: Tokenizer
) -> dict[str, torch.Tensor]:
    """`model` and `tokenizer` as llama.cpp writes a llama; returns the weights the file holds,
    dequantised (what a correct conversion must give back)."""
    config = model.config
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name("tiny-llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(config.hidden_size // HEADS)
    writer.add_rope_freq_base(ROPE_THETA)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)  # "mostly": the file is mixed anyway

    ids = tokenizer.get_vocab()
    vocab = sorted(ids.items(), key=lambda item: item[1])
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([token for token, _ in vocab])
    writer.add_token_types(
        [
            gguf.TokenType.CONTROL if token in SPECIALS else gguf.TokenType.NORMAL
            for token, _ in vocab
        ]
    )
    writer.add_token_merges([" ".join(pair) for pair in merges])
    writer.add_bos_token_id(ids["<|im_start|>"])
    writer.add_eos_token_id(ids["<|im_end|>"])
    writer.add_pad_token_id(ids["<|endoftext|>"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    stored: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight":  # tied: llama.cpp writes no output.weight
            continue
        data = tensor.numpy().astype(np.float32)
        if name.endswith("q_proj.weight"):
            data = llama_cpp_permute(data, HEADS)
        elif name.endswith("k_proj.weight"):
            data = llama_cpp_permute(data, KV_HEADS)
        if name == Q8_0_TENSOR:
            q8 = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
            writer.add_tensor(gguf_name(name), q8, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            back = gguf.quants.dequantize(q8, gguf.GGMLQuantizationType.Q8_0)
            stored[name] = torch.from_numpy(back.reshape(data.shape).copy())
        else:
            writer.add_tensor(gguf_name(name), data)
            stored[name] = tensor.clone()
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    stored["lm_head.weight"] = stored["model.embed_tokens.weight"]
    return stored


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Tiny]:
    root = tmp_path_factory.mktemp("tiny-gguf")
    tokenizer = train_tokenizer()
    model = tiny_model(tokenizer.get_vocab_size())
    file = root / "tiny-llama.F32.gguf"
    reference = write_gguf(file, model, tokenizer)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(root / "cache"))
        converted = resolve_model_path(file)
        yield Tiny(file, reference, tokenizer, root / "cache/jetrl/gguf", converted)


def test_converted_tensors_and_logits_are_the_originals(tiny: Tiny) -> None:
    from safetensors.torch import load_file

    assert tiny.converted.parent == tiny.cache
    assert (tiny.converted / SOURCE_FILE).is_file()
    stored = load_file(tiny.converted / "model.safetensors")
    expected = {k: v for k, v in tiny.reference.items() if k != "lm_head.weight"}
    assert set(stored) <= set(tiny.reference) and set(expected) <= set(stored)
    for name, tensor in expected.items():
        assert torch.equal(stored[name], tensor), (name, (stored[name] - tensor).abs().max())

    config = json.loads((tiny.converted / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert (config["num_key_value_heads"], config["tie_word_embeddings"]) == (KV_HEADS, True)

    model = AutoModelForCausalLM.from_pretrained(tiny.converted).eval()
    original = tiny_model(tiny.tokenizer.get_vocab_size())
    original.load_state_dict(tiny.reference)  # the Q8_0 tensor as the file holds it
    ids = torch.tensor([[5, 40, 200, 7, 99, 301, 12, 3]])
    with torch.no_grad():
        logits, expected_logits = model(ids).logits, original(ids).logits
    assert expected_logits.std() > 1.0  # logits that every weight moves visibly
    assert torch.allclose(logits, expected_logits, atol=1e-4, rtol=1e-4), (
        (logits - expected_logits).abs().max()
    )


def test_tokenizer_and_chat_template_are_kept(tiny: Tiny) -> None:
    names = {p.name for p in tiny.converted.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "chat_template.jinja"} <= names
    assert (tiny.converted / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    tokenizer = AutoTokenizer.from_pretrained(tiny.converted)
    for text in [*TEXTS, "an unseen sentence, with ünïcode", "<|im_start|>user\nhi<|im_end|>"]:
        expected = tiny.tokenizer.encode(text).ids
        assert tokenizer.encode(text, add_special_tokens=False) == expected, text
    messages = [{"role": "user", "content": "hello there"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"
    assert (tokenizer.eos_token, tokenizer.bos_token) == ("<|im_end|>", "<|im_start|>")


def test_resolving_again_converts_nothing(tiny: Tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    def no_conversion(file: Path, out: Path) -> Path:
        raise AssertionError(f"converted {file} again")

    monkeypatch.setattr(engines.gguf, "convert", no_conversion)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tiny.cache.parent.parent))
    assert resolve_model_path(tiny.file) == tiny.converted
    entries = [p.name for p in tiny.cache.iterdir() if not p.name.startswith(".")]
    assert entries == [tiny.converted.name]


def test_the_main_jobs_samples_decode_with_the_conversions_tokenizer(
    tiny: Tiny, monkeypatch: pytest.MonkeyPatch
) -> None:
    # samples.jsonl's text: the producer loads the tokenizer of the model.path the workers load;
    # a .gguf path is its conversion's (found in the cache, not converted again).
    monkeypatch.setenv("XDG_CACHE_HOME", str(tiny.cache.parent.parent))
    decode = load_decoder(RunConfig(model=ModelConfig(path=str(tiny.file))))
    assert decode is not None, "the samples' tokenizer could not be loaded from a .gguf path"
    ids = tiny.tokenizer.encode(TEXTS[0]).ids
    assert decode(ids) == tiny.tokenizer.decode(ids, skip_special_tokens=False)
