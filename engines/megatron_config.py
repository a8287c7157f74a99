"""HF Llama / Qwen2 config -> the arguments of megatron-core's `TransformerConfig` and `GPTModel`.

Pure: no megatron import, so the translation (and its refusals) is tested where megatron-core
is not installed. `engines.megatron_train` passes the two kwargs dicts on as they are.

What maps (HF field -> megatron argument):

    num_hidden_layers       num_layers
    hidden_size             hidden_size
    num_attention_heads     num_attention_heads
    num_key_value_heads     num_query_groups (GQA; equal to the heads: plain multi-head)
    head_dim                kv_channels (Llama may set it apart from hidden / heads)
    intermediate_size       ffn_hidden_size
    rms_norm_eps            layernorm_epsilon, normalization "RMSNorm"
    hidden_act silu         gated_linear_unit + activation_func silu (SwiGLU)
    q/k/v bias (Qwen2)      add_qkv_bias; no other linear has a bias (add_bias_linear False)
    rope theta              rotary_base, position_embedding_type "rope" (not interleaved)
    tie_word_embeddings     share_embeddings_and_output_weights
    vocab_size              vocab_size, padded up to a multiple of the tensor-parallel size
                            (each rank holds an equal vocabulary slice); the pad rows are
                            zeros in, and cut off the logits and the exported weights

Anything else a checkpoint sets that this cannot express (rope scaling, sliding windows,
biases on the MLP or the output projection, another activation, another architecture) is
a one-line ValueError naming the field, not a model that silently computes something else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_TYPES = ("llama", "qwen2")


@dataclass(frozen=True)
class MegatronModelSpec:
    """One GPT model's shape as megatron sees it, plus the parallel layout it is cut into."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    """The HF vocabulary (what the logits and the exported embedding keep)."""
    padded_vocab_size: int
    """`vocab_size` rounded up to a multiple of `tensor_parallel_size`
    (megatron's embedding rows)."""
    max_position_embeddings: int
    rotary_base: float
    layernorm_epsilon: float
    add_qkv_bias: bool
    tie_word_embeddings: bool
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    def transformer_config_kwargs(self) -> dict[str, Any]:
        """`megatron.core.transformer.TransformerConfig(**these)`, less `activation_func` (a
        function, `torch.nn.functional.silu`, which this pure module does not import) and the
        run's dtype and fusion switches (`engines.megatron_train` adds them)."""
        return {
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_query_groups": self.num_query_groups,
            "kv_channels": self.head_dim,
            "ffn_hidden_size": self.ffn_hidden_size,
            "normalization": "RMSNorm",
            "layernorm_epsilon": self.layernorm_epsilon,
            "gated_linear_unit": True,
            "add_bias_linear": False,
            "add_qkv_bias": self.add_qkv_bias,
            # HF Llama/Qwen2 train with no dropout; megatron's defaults are 0.1.
            "hidden_dropout": 0.0,
            "attention_dropout": 0.0,
            "tensor_model_parallel_size": self.tensor_parallel_size,
            "pipeline_model_parallel_size": self.pipeline_parallel_size,
        }

    def gpt_model_kwargs(self) -> dict[str, Any]:
        """`megatron.core.models.gpt.GPTModel(config=..., transformer_layer_spec=..., **these)`."""
        return {
            "vocab_size": self.padded_vocab_size,
            "max_sequence_length": self.max_position_embeddings,
            "position_embedding_type": "rope",
            "rotary_base": self.rotary_base,
            "rotary_percent": 1.0,
            "share_embeddings_and_output_weights": self.tie_word_embeddings,
        }


def spec_from_hf(
    hf_config: Any, tensor_parallel_size: int = 1, pipeline_parallel_size: int = 1
) -> MegatronModelSpec:
    """A transformers `LlamaConfig` / `Qwen2Config` (or anything with their fields) -> the spec.

    Raises ValueError, one line, for a config megatron's GPT layers would compute differently,
    and for parallel sizes the model's shape cannot be divided by.
    """
    model_type = getattr(hf_config, "model_type", None)
    if model_type not in SUPPORTED_TYPES:
        raise ValueError(
            f"megatron engine: model_type {model_type!r} is not supported "
            f"(only {', '.join(SUPPORTED_TYPES)})"
        )
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(
            f"megatron engine: hidden_act {act!r} is not supported (only silu: SwiGLU)"
        )
    for flag in ("mlp_bias", "use_sliding_window"):
        if getattr(hf_config, flag, False):
            raise ValueError(f"megatron engine: {model_type} with {flag}=True is not supported")
    # Llama's attention_bias puts a bias on q, k, v *and* o_proj; megatron's add_bias_linear
    # would add one to the MLP as well, and add_qkv_bias leaves o_proj without: neither fits.
    if model_type == "llama" and getattr(hf_config, "attention_bias", False):
        raise ValueError(
            "megatron engine: llama with attention_bias=True (a bias on o_proj) is not supported"
        )
    rotary_base = _rope_theta(hf_config)
    heads = int(hf_config.num_attention_heads)
    groups = int(getattr(hf_config, "num_key_value_heads", None) or heads)
    hidden = int(hf_config.hidden_size)
    head_dim = int(getattr(hf_config, "head_dim", None) or hidden // heads)
    if heads % groups:
        raise ValueError(
            f"megatron engine: num_attention_heads {heads} "
            f"is not a multiple of num_key_value_heads {groups}"
        )
    tp, pp = int(tensor_parallel_size), int(pipeline_parallel_size)
    if tp < 1 or pp < 1:
        raise ValueError(
            f"megatron engine: parallel sizes must be >= 1 (tensor {tp}, pipeline {pp})"
        )
    if groups % tp:
        raise ValueError(
            f"megatron engine: tensor_parallel_size {tp} does not divide num_key_value_heads "
            f"{groups} (each rank holds whole query groups)"
        )
    ffn = int(hf_config.intermediate_size)
    if ffn % tp:
        raise ValueError(
            f"megatron engine: tensor_parallel_size {tp} does not divide intermediate_size {ffn}"
        )
    layers = int(hf_config.num_hidden_layers)
    if layers % pp:
        raise ValueError(
            f"megatron engine: pipeline_parallel_size {pp} does not divide num_hidden_layers "
            f"{layers}"
        )
    vocab = int(hf_config.vocab_size)
    return MegatronModelSpec(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=groups,
        head_dim=head_dim,
        ffn_hidden_size=ffn,
        vocab_size=vocab,
        padded_vocab_size=-(-vocab // tp) * tp,
        max_position_embeddings=int(hf_config.max_position_embeddings),
        rotary_base=rotary_base,
        layernorm_epsilon=float(hf_config.rms_norm_eps),
        # Qwen2 always has q/k/v biases (its config has no switch for them).
        add_qkv_bias=model_type == "qwen2",
        tie_word_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
    )


def _rope_theta(hf_config: Any) -> float:
    """The RoPE base; refuses any scaling (megatron's plain rope would ignore it).

    transformers 5 keeps it in `rope_parameters` {"rope_type", "rope_theta", ...}; 4.x in
    `rope_theta` with an optional `rope_scaling` dict.
    """
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict):
        kind = params.get("rope_type", "default")
        if kind != "default":
            raise ValueError(f"megatron engine: rope_type {kind!r} is not supported (only default)")
        return float(params["rope_theta"])
    scaling = getattr(hf_config, "rope_scaling", None)
    if scaling:
        raise ValueError(f"megatron engine: rope_scaling {scaling!r} is not supported")
    return float(hf_config.rope_theta)
