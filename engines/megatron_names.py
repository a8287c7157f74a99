"""Parameter names and tensor layouts between HF Llama/Qwen2 and megatron-core's GPTModel,
both ways.

Pure torch (no megatron import). Per layer ``i`` (``L = model.layers.{i}``,
``D = decoder.layers.{i}``):

    HF                                      megatron GPTModel
    model.embed_tokens.weight  [V, H]       embedding.word_embeddings.weight  [Vp, H] (zero rows
                                            past V)
    L.input_layernorm.weight   [H]          D.input_layernorm.weight, or with Transformer Engine's
                                            fused spec D.self_attention.linear_qkv.layer_norm_weight
    L.self_attn.{q,k,v}_proj.weight         D.self_attention.linear_qkv.weight  [(nh + 2 ng) d, H]
                 (and .bias, Qwen2)         D.self_attention.linear_qkv.bias    [(nh + 2 ng) d]
    L.self_attn.o_proj.weight  [H, nh d]    D.self_attention.linear_proj.weight
    L.post_attention_layernorm.weight       D.pre_mlp_layernorm.weight, or fused
                                            D.mlp.linear_fc1.layer_norm_weight
    L.mlp.{gate,up}_proj.weight [F, H]      D.mlp.linear_fc1.weight  [2F, H] = cat[gate, up]
    L.mlp.down_proj.weight     [H, F]       D.mlp.linear_fc2.weight
    model.norm.weight                       decoder.final_layernorm.weight
    lm_head.weight (untied only)            output_layer.weight  [Vp, H] (tied: none, the
                                            embedding serves)

The fused QKV is grouped by query group, not [all q; all k; all v]: megatron's attention views
its rows as [ng, (nh / ng + 2) d] and splits each group's block into its nh / ng query heads,
then its one key head, then its one value head (nh heads, ng groups, head size d). HF's GQA
gives query head h the key/value head h // (nh / ng), so group g's block is
[q heads g*nh/ng .. (g+1)*nh/ng - 1, k head g, v head g].

Tensor parallelism (`shard` / `merge`, rank r of t): column-parallel layers are cut along
rows (linear_qkv: whole groups per rank, because the rows are group-major; the embedding and
output layer: vocabulary slices), except linear_fc1, whose gate and up halves are each cut
and rank r holds cat[gate_r, up_r]; row-parallel layers (linear_proj, linear_fc2) along
columns; the norms are whole on every rank.
"""

from __future__ import annotations

import re

import torch

from engines.megatron_config import MegatronModelSpec

_MC_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.+)")

# HF per-layer suffix -> megatron per-layer suffix, for tensors that map one to one
# (the fused/unfused norm names depend on the layer spec, below).
_ONE_TO_ONE = {
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}
_COLUMN = ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias")
_ROW = ("self_attention.linear_proj.weight", "mlp.linear_fc2.weight")
_VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")


def _norm_names(fused_layernorm: bool) -> dict[str, str]:
    """HF layer norm suffix -> megatron's: Transformer Engine's spec fuses each norm into the
    linear layer after it (`TELayerNormColumnParallelLinear`), the local spec keeps modules."""
    if fused_layernorm:
        return {
            "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
            "post_attention_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
        }
    return {
        "input_layernorm.weight": "input_layernorm.weight",
        "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    }


def fuse_qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: MegatronModelSpec
) -> torch.Tensor:
    """q [nh d, ...], k and v [ng d, ...] -> [(nh + 2 ng) d, ...] group-major
    (see the module doc)."""
    ng, d = spec.num_query_groups, spec.head_dim
    rest = q.shape[1:]
    grouped = (
        q.reshape(ng, spec.heads_per_group * d, *rest),
        k.reshape(ng, d, *rest),
        v.reshape(ng, d, *rest),
    )
    return torch.cat(grouped, dim=1).reshape(-1, *rest)


def split_qkv(
    qkv: torch.Tensor, spec: MegatronModelSpec
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of `fuse_qkv`:
    [(nh + 2 ng) d, ...] -> q [nh d, ...], k [ng d, ...], v [ng d, ...]."""
    ng, d = spec.num_query_groups, spec.head_dim
    rest = qkv.shape[1:]
    q, k, v = qkv.reshape(ng, (spec.heads_per_group + 2) * d, *rest).split(
        [spec.heads_per_group * d, d, d], dim=1
    )
    return q.reshape(-1, *rest), k.reshape(-1, *rest), v.reshape(-1, *rest)


def hf_to_megatron(
    state_dict: dict[str, torch.Tensor], spec: MegatronModelSpec, *, fused_layernorm: bool = False
) -> dict[str, torch.Tensor]:
    """A full HF state dict -> GPTModel's full (unsharded) parameters, new tensors
    (the input is kept).

    A tied model's ``lm_head.weight``, if present, must be the embedding (it is dropped: the
    embedding serves as the output layer). Raises ValueError for a missing or unknown name.
    """
    hf = dict(state_dict)
    out: dict[str, torch.Tensor] = {}
    norms = _norm_names(fused_layernorm)

    def take(name: str) -> torch.Tensor:
        if name not in hf:
            raise ValueError(f"HF -> megatron: {name} is missing from the state dict")
        return hf.pop(name)

    out["embedding.word_embeddings.weight"] = _pad_vocab(take("model.embed_tokens.weight"), spec)
    for i in range(spec.num_layers):
        hf_layer, mc_layer = f"model.layers.{i}.", f"decoder.layers.{i}."
        for hf_suffix, mc_suffix in (*_ONE_TO_ONE.items(), *norms.items()):
            out[mc_layer + mc_suffix] = take(hf_layer + hf_suffix).clone()
        attn = hf_layer + "self_attn."
        params = ("weight", "bias") if spec.add_qkv_bias else ("weight",)
        for param in params:
            q, k, v = (take(f"{attn}{p}_proj.{param}") for p in "qkv")
            out[f"{mc_layer}self_attention.linear_qkv.{param}"] = fuse_qkv(q, k, v, spec)
        gate, up = take(hf_layer + "mlp.gate_proj.weight"), take(hf_layer + "mlp.up_proj.weight")
        out[mc_layer + "mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
    out["decoder.final_layernorm.weight"] = take("model.norm.weight").clone()
    if spec.tie_word_embeddings:
        hf.pop("lm_head.weight", None)
    else:
        out["output_layer.weight"] = _pad_vocab(take("lm_head.weight"), spec)
    if hf:
        raise ValueError(
            f"HF -> megatron: {len(hf)} names this mapping does not know, e.g. {sorted(hf)[0]}"
        )
    return out


def megatron_to_hf(
    state_dict: dict[str, torch.Tensor], spec: MegatronModelSpec, *, fused_layernorm: bool = False
) -> dict[str, torch.Tensor]:
    """GPTModel's full parameters -> HF names, new contiguous tensors: the inverse of
    `hf_to_megatron` (a tied model's embedding once, under ``model.embed_tokens.weight``,
    as the HF model's `named_parameters` lists it). Megatron's ``_extra_state`` entries are
    skipped; any other unknown name or a missing one is a ValueError."""
    mc = {name: t for name, t in state_dict.items() if not name.endswith("._extra_state")}
    out: dict[str, torch.Tensor] = {}
    norms = _norm_names(fused_layernorm)

    def take(name: str) -> torch.Tensor:
        if name not in mc:
            raise ValueError(f"megatron -> HF: {name} is missing from the state dict")
        return mc.pop(name)

    out["model.embed_tokens.weight"] = take("embedding.word_embeddings.weight")[
        : spec.vocab_size
    ].clone()
    for i in range(spec.num_layers):
        hf_layer, mc_layer = f"model.layers.{i}.", f"decoder.layers.{i}."
        for hf_suffix, mc_suffix in (*_ONE_TO_ONE.items(), *norms.items()):
            out[hf_layer + hf_suffix] = take(mc_layer + mc_suffix).clone()
        params = ("weight", "bias") if spec.add_qkv_bias else ("weight",)
        for param in params:
            q, k, v = split_qkv(take(f"{mc_layer}self_attention.linear_qkv.{param}"), spec)
            for proj, tensor in zip("qkv", (q, k, v), strict=True):
                out[f"{hf_layer}self_attn.{proj}_proj.{param}"] = tensor.contiguous()
        gate, up = take(mc_layer + "mlp.linear_fc1.weight").chunk(2, dim=0)
        out[hf_layer + "mlp.gate_proj.weight"] = gate.contiguous()
        out[hf_layer + "mlp.up_proj.weight"] = up.contiguous()
    out["model.norm.weight"] = take("decoder.final_layernorm.weight").clone()
    if not spec.tie_word_embeddings:
        out["lm_head.weight"] = take("output_layer.weight")[: spec.vocab_size].clone()
    if mc:
        raise ValueError(
            f"megatron -> HF: {len(mc)} names this mapping does not know, e.g. {sorted(mc)[0]}"
        )
    return out


def _pad_vocab(table: torch.Tensor, spec: MegatronModelSpec) -> torch.Tensor:
    """[V, H] -> [Vp, H], zero rows past V (megatron's embedding needs Vp divisible by tp)."""
    if table.shape[0] != spec.vocab_size:
        raise ValueError(
            f"HF -> megatron: a vocabulary table has {table.shape[0]} rows, "
            f"the config says {spec.vocab_size}"
        )
    pad = spec.padded_vocab_size - spec.vocab_size
    return torch.nn.functional.pad(table, (0, 0, 0, pad)) if pad else table.clone()


def _kind(name: str) -> str:
    """How `name` (a megatron parameter) is cut over tensor-parallel ranks: column, fc1,
    row or whole."""
    match = _MC_LAYER.fullmatch(name)
    suffix = match.group(2) if match else name
    if suffix in _COLUMN or name in _VOCAB:
        return "column"
    if suffix == "mlp.linear_fc1.weight":
        return "fc1"
    if suffix in _ROW:
        return "row"
    return "whole"  # norms (and their fused layer_norm_weight), the final norm


def shard(name: str, full: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Tensor-parallel rank `rank` of `size`'s part of the full megatron parameter `name` (a
    new contiguous tensor). The caller has checked divisibility (`spec_from_hf`)."""
    if not 0 <= rank < size:
        raise ValueError(f"tensor-parallel rank {rank} is not in 0..{size - 1}")
    kind = _kind(name)
    if kind == "column":
        return full.chunk(size, dim=0)[rank].clone()
    if kind == "fc1":
        gate, up = full.chunk(2, dim=0)
        return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)
    if kind == "row":
        return full.chunk(size, dim=1)[rank].clone()
    return full.clone()


def merge(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The inverse of `shard`: every rank's part of `name`, in rank order -> the full tensor."""
    kind = _kind(name)
    if kind == "column":
        return torch.cat(shards, dim=0)
    if kind == "fc1":
        halves = [s.chunk(2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    if kind == "row":
        return torch.cat(shards, dim=1)
    return shards[0].clone()


# --- pipeline stages (rank r of p holds layers [r L/p, (r+1) L/p), renumbered from 0) ---------


def stage_params(
    full: dict[str, torch.Tensor], spec: MegatronModelSpec, rank: int
) -> dict[str, torch.Tensor]:
    """GPTModel's full parameters -> pipeline stage `rank`'s, under the names its GPTModel (built
    with pre_process on the first stage, post_process on the last) gives them: its layers
    renumbered from 0; the embedding on the first stage; the final norm and the output layer on
    the last. A tied model's last stage (when it is not also the first) holds its own copy of
    the embedding as `output_layer.weight`, which megatron keeps equal by summing the two grads."""
    size = spec.pipeline_parallel_size
    per, first, last = spec.num_layers // size, rank == 0, rank == size - 1
    out: dict[str, torch.Tensor] = {}
    for name, tensor in full.items():
        match = _MC_LAYER.fullmatch(name)
        if match:
            index = int(match.group(1)) - rank * per
            if 0 <= index < per:
                out[f"decoder.layers.{index}.{match.group(2)}"] = tensor
        elif name == "embedding.word_embeddings.weight":
            if first:
                out[name] = tensor
            if last and not first and spec.tie_word_embeddings:
                out["output_layer.weight"] = tensor.clone()
        elif last:
            out[name] = tensor  # decoder.final_layernorm.weight, output_layer.weight
    return out


def unstage_params(
    stages: list[dict[str, torch.Tensor]], spec: MegatronModelSpec
) -> dict[str, torch.Tensor]:
    """The inverse of `stage_params`: every stage's parameters, in stage order -> the full model's
    (a tied model's last-stage output layer dropped: the embedding is the weight)."""
    per, out = spec.num_layers // len(stages), {}
    for rank, stage in enumerate(stages):
        for name, tensor in stage.items():
            match = _MC_LAYER.fullmatch(name)
            if match:
                out[f"decoder.layers.{int(match.group(1)) + rank * per}.{match.group(2)}"] = tensor
            elif not (name == "output_layer.weight" and spec.tie_word_embeddings):
                out[name] = tensor
    return out
