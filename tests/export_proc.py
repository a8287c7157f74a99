"""Trainer checkpoints for tests/test_export.py, and what the engine itself computes at them.

Usage: ``python -m tests.export_proc ENGINE RUN_DIR`` (ENGINE: fsdp, megatron-tp2 or
megatron-pp2; the torch engine runs in the test's own process through `train_and_save`).

Each writes a run directory as the main job would leave it: RUN_DIR/model (the tiny model, with
a chat template; untied embeddings for megatron-tp2, so the output layer's vocabulary cut is
merged too) and RUN_DIR/checkpoints/<engine's pointer> after `STEPS` optimizer steps, then
RUN_DIR/expected.pt: the engine's own log-probs of `probe()` at that checkpoint, which an
export must reproduce. The ranks (2) are spawned gloo processes, each training the same
micro-batches (fsdp: its own rows).
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from engines.tiny import build_tiny_model
from producers.tasks import VOCAB
from tests.fsdp_proc import micro_batch

STEPS = 2
"""Optimizer steps before the checkpoint (the one step it records)."""
ARGS: dict[str, Any] = {"lr": 1e-2, "seed": 0}
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}={% endfor %}"
LAYOUTS = {"megatron-tp2": (2, 1), "megatron-pp2": (1, 2)}
WORLD = 2


def build_model(model_dir: Path, *, tied: bool = True) -> Path:
    """The tiny model with a chat template; `tied` False: its own lm_head (other values)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    build_tiny_model(model_dir, VOCAB, seed=0)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(model_dir)
    if not tied:
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        model.config.tie_word_embeddings = False
        head = model.model.embed_tokens.weight.detach().clone()
        model.lm_head.weight = torch.nn.Parameter(head + 0.05 * torch.randn_like(head))
        model.save_pretrained(model_dir)
    return model_dir


def probe() -> tuple[torch.Tensor, torch.Tensor]:
    """[B, T] ids and an all-ones mask: one row per vocabulary token after a fixed prefix (the
    last position's log-probs are the whole distribution), then random rows."""
    vocab = len(VOCAB)
    prefix = torch.randint(1, vocab, (6,), generator=torch.Generator().manual_seed(1))
    every = torch.cat([prefix.expand(vocab, -1), torch.arange(vocab)[:, None]], dim=1)
    rows = torch.randint(0, vocab, (3, 7), generator=torch.Generator().manual_seed(2))
    ids = torch.cat([every, rows])
    return ids, torch.ones_like(ids)


def batches(rank: int) -> list[list[Any]]:
    """[step][micro] the micro-batches `rank` trains on."""
    rng = np.random.default_rng(11 + rank)
    return [
        [micro_batch(rng, 3, len(VOCAB)), micro_batch(rng, 2, len(VOCAB))] for _ in range(STEPS)
    ]


def train_and_save(engine: Any, run: Path, rank: int, checkpoint: str, rows: int) -> None:
    """`STEPS` steps on `batches(rows)`, the checkpoint, then (rank 0) the engine's log-probs
    there."""
    for step in batches(rows):
        engine.train_step(step)
    engine.save_checkpoint(run / "checkpoints" / checkpoint, {"last_seq": 1})
    logprobs = engine.logprobs(*probe())
    if rank == 0:
        torch.save({"logprobs": logprobs, "step": engine.step}, run / "expected.pt")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_main(rank: int, port: int, engine: str, run: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    if engine == "fsdp":
        from engines.fsdp_train import FSDPTrainEngine

        built: Any = FSDPTrainEngine(Path(run) / "model", **ARGS)
        train_and_save(built, Path(run), rank, "fsdp.pt", rows=rank)
    else:
        from engines.megatron_train import MegatronTrainEngine

        tp, pp = LAYOUTS[engine]
        built = MegatronTrainEngine(
            Path(run) / "model", tensor_parallel_size=tp, pipeline_parallel_size=pp, **ARGS
        )
        # Every rank of the one model copy trains the same micro-batches.
        train_and_save(built, Path(run), rank, "megatron.pt", rows=0)
    dist.destroy_process_group()


def main() -> int:
    import torch.multiprocessing as mp

    engine, run = sys.argv[1], Path(sys.argv[2])
    build_model(run / "model", tied=engine != "megatron-tp2")
    mp.spawn(rank_main, args=(free_port(), engine, str(run)), nprocs=WORLD, join=True)
    print(f"{engine}: checkpoint of step {STEPS} in {run / 'checkpoints'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
