"""A real megatron-core GPTModel on the CPU, loaded through `engines.megatron_names`,
against HF logits.

Usage: ``megatron_cpu_proc.py OUT_DIR [cuda | tp2 | pp2 | tp2pp2]``. Run as its own process by
`tests/test_megatron.py` (it starts a one-rank gloo group and megatron's parallel state, and
patches two CUDA-only spots, none of which a test process should keep). Prints "logits match:
qwen2 llama" when both models agree, then checks `MegatronTrainEngine` against
`TorchTrainEngine` on the tiny model (left-padded rows: the
same log-probs, two steps with the same losses, grad norms and exported weights; a second
engine resumed from the checkpoint before step 1 repeats it exactly) and prints
"engine matches torch"; exits 1 at the first difference. With ``cuda`` only the engine
check runs, on the GPU, with nothing patched (the GPU test); with ``tp2`` it runs on two gloo
ranks with tensor_parallel_size 2, with ``pp2`` on two with pipeline_parallel_size 2 (one
stage each), with ``tp2pp2`` on four (two stages, each cut in two), each rank against its
own torch engine.

megatron-core 0.16 on the CPU: its forward reaches for CUDA twice, both patched by
`engines.megatron_patches.cpu_workarounds` (the engine applies it itself on the CPU; the raw
GPTModel check here applies it first).
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from engines.megatron_config import spec_from_hf
from engines.megatron_names import hf_to_megatron, megatron_to_hf
from engines.megatron_patches import cpu_workarounds
from engines.protocols import MicroBatch
from engines.tiny import build_tiny_model
from engines.torch_train import TorchTrainEngine

TOLERANCE = 1e-5


def hf_models() -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    qwen2 = Qwen2ForCausalLM(
        Qwen2Config(
            vocab_size=15,
            hidden_size=64,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=64,
            tie_word_embeddings=True,
        )
    )
    llama = LlamaForCausalLM(
        LlamaConfig(  # type: ignore[call-arg]  # transformers 5: rope_theta via **kwargs
            vocab_size=15,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=16,
            max_position_embeddings=64,
            tie_word_embeddings=False,
            rope_theta=5e5,
        )
    )
    for model in (qwen2, llama):
        with (
            torch.no_grad()
        ):  # every tensor away from its init (zero biases, unit norms hide swaps)
            for param in model.parameters():
                param.add_(torch.randn_like(param) * 0.05)
    return {"qwen2": qwen2, "llama": llama}


def main() -> int:
    out, device = Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "cpu"
    layouts = {"tp2": (2, 1), "pp2": (1, 2), "tp2pp2": (2, 2)}  # (tensor, pipeline) parallel sizes
    if device in layouts:  # gloo ranks, one model cut over them
        import torch.multiprocessing as mp

        tp, pp = layouts[device]
        mp.spawn(
            tp_rank_main, args=(free_port(), str(out), tp, pp), nprocs=tp * pp, join=True
        )  # raises if a rank fails
        print(f"{device} engine matches torch")
        return 0
    if device != "cpu":  # on a GPU: the engine against the torch engine there, nothing patched
        return engine_matches_torch(out, device)
    cpu_workarounds()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=1, pipeline_model_parallel_size=1
    )
    matched = []
    for name, hf in hf_models().items():
        spec = spec_from_hf(hf.config)
        config = TransformerConfig(
            **spec.transformer_config_kwargs(),
            activation_func=F.silu,
            use_cpu_initialization=True,
            bias_activation_fusion=False,
            bias_dropout_fusion=False,
            apply_rope_fusion=False,
            masked_softmax_fusion=False,
            persist_layer_norm=False,
            gradient_accumulation_fusion=False,
        )
        model = GPTModel(
            config=config,
            transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
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
        causal = torch.triu(torch.ones(ids.shape[1], ids.shape[1], dtype=torch.bool), 1)[
            None, None
        ]  # True: masked
        model.eval()
        with torch.no_grad():
            got = model(ids, positions, attention_mask=causal)  # [B, T, V]
            want = hf(input_ids=ids).logits
        diff = (got - want).abs().max().item()
        print(
            f"{name}: max |megatron - HF| logit {diff:.3g} (logits up to "
            f"{want.abs().max().item():.3g})"
        )
        if diff > TOLERANCE:
            return 1
        back = megatron_to_hf(dict(model.state_dict()), spec)
        if back.keys() != hf_state.keys() or not all(
            torch.equal(back[n], t) for n, t in hf_state.items()
        ):
            print(f"{name}: megatron's state_dict does not map back to the HF weights")
            return 1
        matched.append(name)
    print("logits match:", " ".join(matched))
    code = engine_matches_torch(out, device)
    dist.destroy_process_group()
    return code


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tp_rank_main(rank: int, port: int, out: str, tp: int, pp: int) -> None:
    cpu_workarounds()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=tp * pp)
    code = engine_matches_torch(Path(out), "cpu", tp=tp, pp=pp)
    dist.destroy_process_group()
    if code:
        raise SystemExit(
            f"rank {rank} (tp {tp}, pp {pp}): the engine differs from the torch engine"
        )


def engine_matches_torch(out: Path, device: str, tp: int = 1, pp: int = 1) -> int:
    from engines.megatron_train import MegatronTrainEngine
    from producers.tasks import VOCAB

    model_dir = out / "tiny"
    if tp * pp == 1 or dist.get_rank() == 0:
        build_tiny_model(model_dir, VOCAB, seed=0)
    if tp * pp > 1:
        dist.barrier()  # rank 0 wrote the model
    args: dict[str, Any] = {"lr": 1e-4, "seed": 0, "device": device}
    torch_engine = TorchTrainEngine(model_dir, **args)
    megatron = MegatronTrainEngine(
        model_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp, **args
    )
    lead = megatron.rank == 0  # the rank export_weights returns the weights on
    # Its own generator: the engines' inits draw from the global one differently per tp size.
    ids = torch.randint(1, len(VOCAB), (3, 9), generator=torch.Generator().manual_seed(3))
    attention = torch.ones_like(ids)
    attention[1, :3] = 0  # left padding
    attention[2, 7:] = 0  # right padding
    loss_mask = torch.zeros_like(ids)
    loss_mask[:, 5:7] = 1
    want = torch_engine.logprobs(ids, attention)
    got = megatron.logprobs(ids, attention)
    # Compared where token t and its predecessor are real: a first real token after left
    # padding is predicted from a pad position that sees no key at all, which each
    # implementation fills its own way (never a loss token).
    scored = attention * torch.nn.functional.pad(attention[:, :-1], (1, 0))
    diff = ((got - want) * scored).abs().max().item()
    print(f"engine: max |log-prob difference| {diff:.3g}")
    if diff > TOLERANCE:
        return 1
    batch = MicroBatch(
        ids, attention, loss_mask, torch.tensor([1.0, -0.5, 2.0]), (want - 0.02) * loss_mask
    )
    # A second micro-batch of another [B, T]: the step accumulates over both (at pipeline
    # parallel they pass the stages in megatron's schedule, each activation's shape sent first).
    short = MicroBatch(
        ids[:2, :7],
        attention[:2, :7],
        loss_mask[:2, :7],
        torch.tensor([-1.0, 0.5]),
        (want[:2, :7] + 0.01) * loss_mask[:2, :7],
    )
    checkpoint = out / "checkpoints" / "megatron.pt"
    for step in range(2):
        if step == 1:
            megatron.save_checkpoint(checkpoint, {"last_seq": 7})
        a, b = torch_engine.train_step([batch, short]), megatron.train_step([batch, short])
        print(
            f"engine step {step}: loss {a['loss']:.6g} / {b['loss']:.6g}, "
            f"grad_norm {a['grad_norm']:.6g} / {b['grad_norm']:.6g}"
        )
        if any(
            abs(a[k] - b[k]) > TOLERANCE * max(1.0, abs(a[k]))
            for k in ("loss", "grad_norm", "entropy", "ratio_mean")
        ):
            return 1
        if not a["grad_norm"] > 0:  # every token clipped: the step would check no gradient
            print("engine: a step with no gradient checks nothing")
            return 1
    theirs, ours = torch_engine.export_weights(), megatron.export_weights()
    if not lead:
        theirs = ours  # the others get {}; the lead compares
    if theirs.keys() != ours.keys():
        print(f"engine: exported names differ: {sorted(theirs.keys() ^ ours.keys())[:3]}")
        return 1
    worst = max((theirs[n] - ours[n]).abs().max().item() for n in theirs) if theirs else 0.0
    print(f"engine: max |weight difference| after 2 steps {worst:.3g}")
    # AdamW divides by sqrt(v): a parameter whose gradient is ~0 moves by up to lr on float
    # noise alone, so the weights agree to a fraction of lr, not to the logits' tolerance.
    if worst > 0.1 * args["lr"]:
        return 1
    # Resume: a new engine from the checkpoint written before step 1 takes step 1 as the first did.
    resumed = MegatronTrainEngine(
        model_dir, tensor_parallel_size=tp, pipeline_parallel_size=pp, **args
    )
    if not resumed.has_checkpoint(checkpoint) or resumed.load_checkpoint(checkpoint) != {
        "last_seq": 7
    }:
        print("engine: the checkpoint did not load back")
        return 1
    resumed.train_step([batch, short])
    again = resumed.export_weights()
    if resumed.step != 2 or not all(torch.equal(again[n], ours[n]) for n in ours):
        print("engine: the resumed step differs from the uninterrupted one")
        return 1
    print("engine matches torch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
