"""Megatron-core engine, the parts that need no GPU: HF config -> megatron arguments, and the
parameter mapping HF <-> GPTModel (fused QKV layout, fused gate/up, tensor-parallel cuts).

The mapping is checked three ways: a hand-written fused QKV (so a wrong group layout fails
even if both directions agree with each other), bit-exact round trips on real HF models, and,
where megatron-core is installed, a real GPTModel built on the CPU from our arguments and
weights whose logits must equal the HF model's (`tests/megatron_cpu_proc.py`).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
)

from engines.megatron_config import spec_from_hf
from engines.megatron_names import (
    fuse_qkv,
    hf_to_megatron,
    megatron_to_hf,
    merge,
    shard,
    split_qkv,
    stage_params,
    unstage_params,
)
from engines.tiny import build_tiny_model
from producers.tasks import VOCAB
from schemas.trainer_config import MegatronConfig

pytestmark = pytest.mark.slow  # a minute or more of real runs: -m 'not slow' skips it


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    """The project's tiny model: Qwen2, tied embeddings, q/k/v biases, 4 heads over 2 KV heads."""
    model_dir = build_tiny_model(tmp_path_factory.mktemp("megatron") / "qwen2", VOCAB, seed=0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():  # random biases: HF initialises them to zero, which would hide a swap
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_()
    return model


def tiny_llama(tie: bool = False) -> torch.nn.Module:
    """Llama with GQA 4:1 and head_dim apart from hidden / heads (8 * 16 != 64), vocab 15."""
    torch.manual_seed(1)
    config = LlamaConfig(
        vocab_size=15,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=tie,
        rope_theta=5e5,
    )  # type: ignore[call-arg]  # transformers 5 takes rope_theta through **kwargs
    return LlamaForCausalLM(config)


def hf_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """What a train engine exports: named_parameters (a tied weight once)."""
    return {name: p.detach().clone() for name, p in model.named_parameters()}


# --- the fused QKV layout, by hand -----------------------------------------------------------


def test_qkv_is_fused_group_major_as_megatron_reads_it() -> None:
    """4 query heads in 2 groups, head_dim 2: group g's rows are [q heads 2g, 2g+1; k head g;
    v head g]."""
    spec = spec_from_hf(
        Qwen2Config(
            hidden_size=8, num_attention_heads=4, num_key_value_heads=2, intermediate_size=8
        )
    )
    assert (spec.head_dim, spec.num_query_groups) == (2, 2)
    # Row r of q is q head r // 2, element r % 2; values say which: q 0..7, k 100.., v 200..
    q, k, v = torch.arange(8.0), torch.arange(100.0, 104.0), torch.arange(200.0, 204.0)
    expected = [
        0,
        1,
        2,
        3,
        100,
        101,
        200,
        201,  # group 0: q heads 0 and 1, k head 0, v head 0
        4,
        5,
        6,
        7,
        102,
        103,
        202,
        203,  # group 1: q heads 2 and 3, k head 1, v head 1
    ]
    assert fuse_qkv(q, k, v, spec).tolist() == expected
    # A weight: the same row order, each row kept whole.
    weight = fuse_qkv(
        q[:, None].repeat(1, 3), k[:, None].repeat(1, 3), v[:, None].repeat(1, 3), spec
    )
    assert weight[:, 0].tolist() == expected and torch.equal(weight[:, 0], weight[:, 2])
    back = split_qkv(torch.tensor(expected, dtype=torch.float32), spec)
    assert [t.tolist() for t in back] == [q.tolist(), k.tolist(), v.tolist()]


# --- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("fused_layernorm", [False, True])
def test_qwen2_round_trip_is_bit_exact(tiny_qwen2: torch.nn.Module, fused_layernorm: bool) -> None:
    spec = spec_from_hf(tiny_qwen2.config)
    hf = hf_params(tiny_qwen2)
    mc = hf_to_megatron(hf, spec, fused_layernorm=fused_layernorm)
    assert "output_layer.weight" not in mc  # tied: the embedding is the output layer
    layer = "decoder.layers.0.self_attention.linear_qkv."
    assert mc[layer + "weight"].shape == ((4 + 2 * 2) * 16, 64) and mc[layer + "bias"].shape == (
        128,
    )
    assert mc["decoder.layers.0.mlp.linear_fc1.weight"].shape == (2 * 256, 64)
    norm = (
        "self_attention.linear_qkv.layer_norm_weight"
        if fused_layernorm
        else "input_layernorm.weight"
    )
    assert torch.equal(mc[f"decoder.layers.1.{norm}"], hf["model.layers.1.input_layernorm.weight"])
    back = megatron_to_hf(mc, spec, fused_layernorm=fused_layernorm)
    assert back.keys() == hf.keys()
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def test_untied_llama_round_trip_is_bit_exact_and_fc1_is_gate_then_up() -> None:
    model = tiny_llama()
    spec = spec_from_hf(model.config)
    hf = hf_params(model)
    assert "lm_head.weight" in hf
    mc = hf_to_megatron(hf, spec)
    assert torch.equal(mc["output_layer.weight"], hf["lm_head.weight"])
    fc1 = mc["decoder.layers.1.mlp.linear_fc1.weight"]
    assert torch.equal(fc1[:96], hf["model.layers.1.mlp.gate_proj.weight"])
    assert torch.equal(fc1[96:], hf["model.layers.1.mlp.up_proj.weight"])
    assert torch.equal(
        mc["decoder.layers.1.self_attention.linear_proj.weight"],
        hf["model.layers.1.self_attn.o_proj.weight"],
    )
    back = megatron_to_hf(mc, spec)
    assert back.keys() == hf.keys()
    assert all(torch.equal(back[name], tensor) for name, tensor in hf.items())


def test_unknown_or_missing_names_are_refused(tiny_qwen2: torch.nn.Module) -> None:
    spec = spec_from_hf(tiny_qwen2.config)
    hf = hf_params(tiny_qwen2)
    with pytest.raises(
        ValueError,
        match="names this mapping does not know, e.g. model.layers.0.self_attn.q_norm.weight",
    ):
        hf_to_megatron({**hf, "model.layers.0.self_attn.q_norm.weight": torch.ones(16)}, spec)
    del hf["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ValueError, match="model.layers.1.mlp.up_proj.weight is missing"):
        hf_to_megatron(hf, spec)


# --- tensor parallelism -----------------------------------------------------------------------


def test_tp2_shards_are_megatrons_cuts_and_merge_back_exactly(tiny_qwen2: torch.nn.Module) -> None:
    spec = spec_from_hf(tiny_qwen2.config, tensor_parallel_size=2)
    full = hf_to_megatron(hf_params(tiny_qwen2), spec)
    for name, tensor in full.items():
        parts = [shard(name, tensor, rank, 2) for rank in range(2)]
        assert torch.equal(merge(name, parts), tensor), name
    qkv = full[
        "decoder.layers.0.self_attention.linear_qkv.weight"
    ]  # [2 groups x (2 q + k + v) x 16, 64]
    assert torch.equal(
        shard("decoder.layers.0.self_attention.linear_qkv.weight", qkv, 1, 2), qkv[64:]
    )  # group 1
    fc1 = full["decoder.layers.0.mlp.linear_fc1.weight"]  # [gate 256; up 256]
    rank1 = shard("decoder.layers.0.mlp.linear_fc1.weight", fc1, 1, 2)
    assert torch.equal(rank1, torch.cat([fc1[128:256], fc1[384:]]))  # gate half 1, then up half 1
    proj = full["decoder.layers.0.self_attention.linear_proj.weight"]
    assert torch.equal(
        shard("decoder.layers.0.self_attention.linear_proj.weight", proj, 0, 2), proj[:, :32]
    )
    norm = full["decoder.layers.0.input_layernorm.weight"]
    assert torch.equal(shard("decoder.layers.0.input_layernorm.weight", norm, 1, 2), norm)


@pytest.mark.parametrize("tie", [False, True])
def test_pipeline_stages_hold_their_layers_renumbered_and_merge_back(tie: bool) -> None:
    """4 layers over 2 stages: stage 1 holds layers 2, 3 as 0, 1, the final norm and the output
    layer (tied: its own copy of the embedding); stage 0 the embedding and layers 0, 1."""
    torch.manual_seed(2)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=15,
            hidden_size=32,
            intermediate_size=48,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=tie,
        )
    )
    spec = spec_from_hf(model.config, pipeline_parallel_size=2)
    full = hf_to_megatron(hf_params(model), spec)
    first, last = stage_params(full, spec, 0), stage_params(full, spec, 1)
    assert (
        "embedding.word_embeddings.weight" in first
        and "decoder.final_layernorm.weight" not in first
    )
    assert {n.split(".")[2] for n in first if n.startswith("decoder.layers.")} == {"0", "1"}
    assert torch.equal(
        last["decoder.layers.0.mlp.linear_fc2.weight"],
        full["decoder.layers.2.mlp.linear_fc2.weight"],
    )
    assert torch.equal(
        last["decoder.layers.1.input_layernorm.weight"],
        full["decoder.layers.3.input_layernorm.weight"],
    )
    assert "embedding.word_embeddings.weight" not in last
    want_output = full["embedding.word_embeddings.weight"] if tie else full["output_layer.weight"]
    assert torch.equal(last["output_layer.weight"], want_output)
    back = unstage_params([first, last], spec)
    assert back.keys() == full.keys() and all(torch.equal(back[n], t) for n, t in full.items())


def test_odd_vocab_is_padded_for_tp_and_cut_back() -> None:
    model = tiny_llama()
    spec = spec_from_hf(model.config, tensor_parallel_size=2)
    assert (spec.vocab_size, spec.padded_vocab_size) == (15, 16)
    hf = hf_params(model)
    mc = hf_to_megatron(hf, spec)
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        assert mc[name].shape == (16, 64) and not mc[name][15:].any()
        assert shard(name, mc[name], 1, 2).shape == (8, 64)
    back = megatron_to_hf(mc, spec)
    assert all(torch.equal(back[name], tensor) for name, tensor in hf.items())


# --- config translation -----------------------------------------------------------------------


def test_tiny_configs_translate(tiny_qwen2: torch.nn.Module) -> None:
    spec = spec_from_hf(tiny_qwen2.config)
    kwargs = spec.transformer_config_kwargs()
    assert kwargs == {
        "num_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_query_groups": 2,
        "kv_channels": 16,
        "ffn_hidden_size": 256,
        "normalization": "RMSNorm",
        "layernorm_epsilon": tiny_qwen2.config.rms_norm_eps,  # type: ignore[union-attr]
        "gated_linear_unit": True,
        "add_bias_linear": False,
        "add_qkv_bias": True,
        "hidden_dropout": 0.0,
        "attention_dropout": 0.0,
        "tensor_model_parallel_size": 1,
        "pipeline_model_parallel_size": 1,
    }
    assert spec.gpt_model_kwargs() == {
        "vocab_size": len(VOCAB),
        "max_sequence_length": 64,
        "position_embedding_type": "rope",
        "rotary_base": tiny_qwen2.config.rope_parameters["rope_theta"],  # type: ignore[union-attr, index]
        "rotary_percent": 1.0,
        "share_embeddings_and_output_weights": True,
    }
    llama = spec_from_hf(tiny_llama().config, tensor_parallel_size=2)
    assert (llama.add_qkv_bias, llama.tie_word_embeddings, llama.head_dim, llama.rotary_base) == (
        False,
        False,
        16,
        5e5,
    )
    assert llama.transformer_config_kwargs()["tensor_model_parallel_size"] == 2


@pytest.mark.parametrize(
    ("change", "tp", "error"),
    [
        ({"model_type": "gpt2"}, 1, "model_type 'gpt2' is not supported"),
        ({"hidden_act": "gelu"}, 1, "hidden_act 'gelu' is not supported"),
        ({"attention_bias": True}, 1, "attention_bias=True"),
        ({"mlp_bias": True}, 1, "mlp_bias=True"),
        (
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
            1,
            "rope_type 'yarn'",
        ),
        ({}, 4, "tensor_parallel_size 4 does not divide num_key_value_heads 2"),
        (
            {"intermediate_size": 97, "num_key_value_heads": 8, "num_attention_heads": 8},
            2,
            "does not divide intermediate_size 97",
        ),
    ],
)
def test_what_megatron_cannot_express_is_one_line_error(change: dict, tp: int, error: str) -> None:
    config = tiny_llama().config
    for key, value in change.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=error) as info:
        spec_from_hf(config, tensor_parallel_size=tp)
    assert "\n" not in str(info.value)


def test_sliding_window_qwen2_is_refused() -> None:
    config = AutoConfig.for_model("qwen2", use_sliding_window=True, sliding_window=16)
    with pytest.raises(ValueError, match="use_sliding_window=True"):
        spec_from_hf(config)


# --- a real GPTModel on the CPU (where megatron-core is installed) ----------------------------


def test_megatron_gpt_model_and_engine_on_cpu_compute_what_hf_does(tmp_path: Path) -> None:
    """Our arguments build megatron's GPTModel (local layer spec, CPU init), our mapping loads
    the HF weights into it, and its logits equal the HF model's: Qwen2 (tied, biases) and Llama
    (untied, head_dim apart). Only this checks the layout against megatron's own attention.
    Then `MegatronTrainEngine` on the tiny model: the torch engine's log-probs on padded rows,
    its losses and grad norms over two steps, and its exported weights (HF names)."""
    if (
        importlib.util.find_spec("megatron") is None
        or importlib.util.find_spec("megatron.core") is None
    ):
        pytest.skip("megatron-core is not installed (pip install 'jetrl[megatron]')")
    proc = Path(__file__).with_name("megatron_cpu_proc.py")
    root = str(Path(__file__).parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(proc), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "logits match: qwen2 llama" in done.stdout
    assert "engine matches torch" in done.stdout


def test_megatron_engine_cut_over_two_cpu_ranks_trains_as_the_torch_engine(tmp_path: Path) -> None:
    """Tensor parallel 2 over gloo: each rank's cut of the weights, the logits gathered over the
    vocabulary (15 padded to 16), the grad norm summed over the cuts, the export gathered and
    merged back to HF names, a checkpoint per rank: against the one-process torch engine."""
    if (
        importlib.util.find_spec("megatron") is None
        or importlib.util.find_spec("megatron.core") is None
    ):
        pytest.skip("megatron-core is not installed (pip install 'jetrl[megatron]')")
    proc = Path(__file__).with_name("megatron_cpu_proc.py")
    root = str(Path(__file__).parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(proc), str(tmp_path), "tp2"],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "tp2 engine matches torch" in done.stdout


@pytest.mark.parametrize("layout", ["pp2", "tp2pp2"])
def test_megatron_engine_in_two_pipeline_stages_trains_as_the_torch_engine(
    tmp_path: Path, layout: str
) -> None:
    """Pipeline parallel 2 over gloo (2 ranks; and 4, each stage also at tensor parallel 2), one
    layer per stage: megatron's 1F1B schedule over two micro-batches of different shapes, the
    loss on the last stage, the tied embedding's two copies (first stage's input, last stage's
    output layer) summing their gradients, the grad norm over both stages, the export gathered
    from both stages under HF names, a checkpoint per rank: against the one-process torch
    engine, to float tolerance."""
    if (
        importlib.util.find_spec("megatron") is None
        or importlib.util.find_spec("megatron.core") is None
    ):
        pytest.skip("megatron-core is not installed (pip install 'jetrl[megatron]')")
    proc = Path(__file__).with_name("megatron_cpu_proc.py")
    root = str(Path(__file__).parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(proc), str(tmp_path), layout],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert f"{layout} engine matches torch" in done.stdout


def test_megatron_engine_on_a_gpu_trains_as_the_torch_engine(tmp_path: Path) -> None:
    """The same engine check on CUDA, megatron-core unpatched. Never run yet (no GPU so far)."""
    if not torch.cuda.is_available():
        pytest.skip("no GPU: MegatronTrainEngine has never run on CUDA")
    if (
        importlib.util.find_spec("megatron") is None
        or importlib.util.find_spec("megatron.core") is None
    ):
        pytest.skip("megatron-core is not installed (pip install 'jetrl[megatron]')")
    proc = Path(__file__).with_name("megatron_cpu_proc.py")
    root = str(Path(__file__).parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [sys.executable, str(proc), str(tmp_path), "cuda"],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert "engine matches torch" in done.stdout


# --- config and the engine's import ---------------------------------------------------------


def test_trainer_config_takes_megatron_and_refuses_what_it_cannot_run() -> None:
    from pydantic import ValidationError

    from schemas.config import RunConfig

    cfg = RunConfig.model_validate({"trainer": {"engine": "megatron"}})
    assert isinstance(cfg.trainer.engine, MegatronConfig)
    assert (cfg.trainer.engine.tensor_parallel_size, cfg.trainer.engine.pipeline_parallel_size) == (
        1,
        1,
    )
    tp2 = RunConfig.model_validate(
        {"trainer": {"engine": {"type": "megatron", "tensor_parallel_size": 2}}}
    )
    assert (
        tp2.trainer.ranks == 2
    )  # tensor-parallel ranks are trainer processes (tests/test_megatron_job.py)
    both = RunConfig.model_validate(
        {
            "trainer": {
                "engine": {
                    "type": "megatron",
                    "tensor_parallel_size": 2,
                    "pipeline_parallel_size": 2,
                }
            }
        }
    )
    assert (both.trainer.copy_size, both.trainer.ranks) == (
        4,
        4,
    )  # one copy: tp x pp ranks, all on batches.0
    for bad, error in (
        ({"engine": {"type": "megatron", "pipeline_parallel_size": 0}}, "pipeline_parallel_size"),
        ({"engine": "megatron", "dp_size": 2}, "dp_size 2 needs engine fsdp: the megatron engine"),
    ):
        with pytest.raises(ValidationError, match=error):
            RunConfig.model_validate({"trainer": bad})


def test_engine_without_megatron_core_says_what_to_install(
    tiny_qwen2: torch.nn.Module, tmp_path: Path
) -> None:
    if (
        importlib.util.find_spec("megatron") is not None
        and importlib.util.find_spec("megatron.core") is not None
    ):
        pytest.skip("megatron-core is installed here")
    from bus.runtime import CannotAttach
    from consumers.trainer_dist import configured_engine
    from engines.torch_train import LossConfig
    from schemas.config import RunConfig

    cfg = RunConfig.model_validate(
        {"trainer": {"engine": "megatron"}, "model": {"path": str(tmp_path)}}
    )
    # The trainer's one-line start-up error (exit 1, the line said), not a traceback.
    with pytest.raises(
        CannotAttach,
        match=r"^trainer.engine megatron needs megatron-core: pip install 'jetrl\[megatron\]'$",
    ):
        configured_engine(cfg, LossConfig(), torch.device("cpu"))
