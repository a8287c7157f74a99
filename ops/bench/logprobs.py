"""`python -m ops.bench.logprobs [--quick]`: peak memory of the trainer's log-probs,
chunked vs full logits.

One forward and backward of per-token log-probs and entropy at V = 32k vocabulary and
T = 4k tokens (T = 2k with `--quick`), hidden size 1024, float32: from the final
hidden states [T, H] and the output projection [V, H], the loss a sum of both weighted by
random per-token factors (so both get gradients, as an entropy bonus would).

    naive   logits [T, V] -> log_softmax -> gather, entropy (autograd keeps [T, V] tensors)
    ours    `engines.algorithms.logprobs.chunked_logprobs` at the trainer's default chunk
            (`trainer.logprob_chunk_tokens`)

Each path runs in a fresh subprocess; its peak is the growth of the process's peak resident
memory over what the inputs already took (CPU), or `torch.cuda.max_memory_allocated` over the
inputs (GPU). The two paths' values are compared too (max |difference|). Last line: JSON with
"ratio" = ours / naive peak memory (target <= 0.3) and the seconds of each.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

from engines.algorithms.logprobs import chunked_logprobs, naive_logprobs
from schemas.config import TrainerConfig

HIDDEN = 1024
VOCAB = 32_000


def rss_peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def measure(path: str, tokens: int, chunk: int) -> dict:
    """One path's peak memory over its inputs, its seconds, and a checksum of its outputs."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator().manual_seed(0)
    hidden = (torch.randn(tokens, HIDDEN, generator=gen) * 0.05).to(device).requires_grad_()
    weight = (torch.randn(VOCAB, HIDDEN, generator=gen) * 0.05).to(device).requires_grad_()
    targets = torch.randint(0, VOCAB, (tokens,), generator=gen).to(device)
    factors = torch.randn(2, tokens, generator=gen).to(device)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = current_rss_bytes()
    started = time.perf_counter()
    if path == "ours":
        logprobs, entropy = chunked_logprobs(hidden, weight, targets, 1.0, chunk)
    else:
        logprobs, entropy = naive_logprobs(hidden, weight, targets, 1.0)
    ((logprobs * factors[0]).sum() + (entropy * factors[1]).sum()).backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = rss_peak_bytes() - base
    seconds = time.perf_counter() - started
    assert hidden.grad is not None  # backward ran on a leaf that requires grad
    return {
        "peak_mb": round(peak / 2**20, 1),
        "seconds": round(seconds, 3),
        "device": device.type,
        "logprobs": logprobs.detach().cpu().tolist()[:64],
        "grad_hidden_sum": float(hidden.grad.double().sum()),
    }


def in_subprocess(path: str, tokens: int, chunk: int) -> dict:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ops.bench.logprobs",
            "--one",
            path,
            "--tokens",
            str(tokens),
            "--chunk",
            str(chunk),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m ops.bench.logprobs", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--quick", action="store_true", help="T = 2k tokens instead of 4k")
    parser.add_argument("--one", choices=["ours", "naive"], help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--chunk", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    chunk = args.chunk or TrainerConfig().logprob_chunk_tokens
    tokens = args.tokens or (2048 if args.quick else 4096)
    if args.one:
        print(json.dumps(measure(args.one, tokens, chunk)))
        return
    runs = {}
    for path in ("naive", "ours"):
        runs[path] = in_subprocess(path, tokens, chunk)
        print(
            f"{path:5s}: peak {runs[path]['peak_mb']:8.1f} MiB over the inputs, "
            f"{runs[path]['seconds']:.2f} s ({runs[path]['device']})",
            flush=True,
        )
    difference = max(
        abs(a - b) for a, b in zip(runs["ours"]["logprobs"], runs["naive"]["logprobs"], strict=True)
    )
    print(
        json.dumps(
            {
                "bench": "logprobs",
                "quick": args.quick,
                "tokens": tokens,
                "vocab": VOCAB,
                "hidden": HIDDEN,
                "chunk": chunk,
                "device": runs["ours"]["device"],
                "naive_peak_mb": runs["naive"]["peak_mb"],
                "ours_peak_mb": runs["ours"]["peak_mb"],
                "naive_seconds": runs["naive"]["seconds"],
                "ours_seconds": runs["ours"]["seconds"],
                "max_logprob_difference": difference,
                "grad_hidden_sum": [
                    runs["naive"]["grad_hidden_sum"],
                    runs["ours"]["grad_hidden_sum"],
                ],
                "ratio": round(runs["ours"]["peak_mb"] / runs["naive"]["peak_mb"], 3),
            }
        )
    )


if __name__ == "__main__":
    main()
