"""A real megatron-core GPTModel on the CPU, loaded through `engines.megatron_names`, against HF logits.

Run as its own process by `tests/test_megatron.py` (it starts a one-rank gloo group and
megatron's parallel state, and patches two CUDA-only spots, none of which a test process
should keep). Exits 0 and prints "logits match: qwen2 llama" when both models agree.

megatron-core 0.16 on the CPU, with the local (non Transformer Engine) layer spec: the model
builds (`use_cpu_initialization`), but its forward reaches for CUDA twice, both patched here:
the rotary embedding moves its frequencies to ``torch.cuda.current_device()``, and the
attention forks the model-parallel CUDA RNG state around dropout (dropout is 0 here).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from engines.megatron_config import spec_from_hf
from engines.megatron_names import hf_to_megatron, megatron_to_hf

TOLERANCE = 1e-5


def hf_models() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    qwen2 = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=15, hidden_size=64, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
    ))
    llama = LlamaForCausalLM(LlamaConfig(
        vocab_size=15, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False, rope_theta=5e5,
    ))
    for model in (qwen2, llama):
        with torch.no_grad():  # every tensor away from its init (zero biases, unit norms hide swaps)
            for param in model.parameters():
                param.add_(torch.randn_like(param) * 0.05)
    return {"qwen2": qwen2, "llama": llama}


def main() -> int:
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment, return-value]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    tensor_parallel.get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()  # type: ignore[method-assign]
    matched = []
    for name, hf in hf_models().items():
        spec = spec_from_hf(hf.config)
        config = TransformerConfig(
            **spec.transformer_config_kwargs(), activation_func=F.silu, use_cpu_initialization=True,
            bias_activation_fusion=False, bias_dropout_fusion=False, apply_rope_fusion=False,
            masked_softmax_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        )
        model = GPTModel(
            config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
            **spec.gpt_model_kwargs(),
        )
        hf_state = {n: p.detach().clone() for n, p in hf.named_parameters()}
        missing, unexpected = model.load_state_dict(hf_to_megatron(hf_state, spec), strict=False)
        missing = [n for n in missing if not n.endswith("._extra_state")]
        if missing or unexpected:
            print(f"{name}: missing {missing}, unexpected {unexpected}")
            return 1
        ids = torch.randint(0, spec.vocab_size, (2, 10))
        positions = torch.arange(ids.shape[1]).expand_as(ids)
        causal = torch.triu(torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool), 1)[None, None]  # True: masked
        model.eval()
        with torch.no_grad():
            got = model(ids, positions, attention_mask=causal)  # [B, T, V]
            want = hf(input_ids=ids).logits
        diff = (got - want).abs().max().item()
        print(f"{name}: max |megatron - HF| logit {diff:.3g} (logits up to {want.abs().max().item():.3g})")
        if diff > TOLERANCE:
            return 1
        back = megatron_to_hf(dict(model.state_dict()), spec)
        if back.keys() != hf_state.keys() or not all(torch.equal(back[n], t) for n, t in hf_state.items()):
            print(f"{name}: megatron's state_dict does not map back to the HF weights")
            return 1
        matched.append(name)
    print("logits match:", " ".join(matched))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
