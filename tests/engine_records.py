"""Engine outputs as vLLM and SGLang report them, for CPU tests of their adapters.

The recorded fixtures (`tests/golden/vllm_request_output.json`, `sglang_generate_output.json`)
are JSON; vLLM hands back objects (`RequestOutput`, `CompletionOutput`, `Logprob`), so
`vllm_objects` rebuilds them as attribute objects with int token keys, as vLLM has them.
`vllm_report` / `sglang_report` write the same shapes from samples our HF engine drew: what
each engine would report had it drawn them.
"""

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from engines.protocols import Sample
from engines.tiny import build_tiny_model
from engines.torch_train import LossConfig, TorchTrainEngine
from ops.gpu.external import response_logprobs
from producers.tasks import VOCAB

GOLDEN = Path(__file__).parent / "golden"
TEMPERATURE = 0.7
"""Sampling temperature of the alignment tests: not 1, so the log-probs must apply it."""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny"), VOCAB, seed=0)


def trainer_logprobs(
    model_dir: Path, prompts: list[list[int]], groups: list[list[Sample]]
) -> torch.Tensor:
    """[sum of response lengths] what the trainer computes for every response token,
    at `TEMPERATURE`."""
    engine = TorchTrainEngine(model_dir, lr=1e-3, loss=LossConfig(temperature=TEMPERATURE))
    return response_logprobs(engine, prompts, groups)


def load(name: str) -> dict[str, Any]:
    return json.loads((GOLDEN / name).read_text())


def vllm_objects(requests: list[dict[str, Any]]) -> list[SimpleNamespace]:
    """JSON `RequestOutput`s as objects: ``outputs`` of completions, logprobs keyed by int."""

    def completion(c: dict[str, Any]) -> SimpleNamespace:
        logprobs = (
            None
            if c["logprobs"] is None
            else [
                {int(token): SimpleNamespace(**entry) for token, entry in position.items()}
                for position in c["logprobs"]
            ]
        )
        return SimpleNamespace(**{**c, "logprobs": logprobs})

    return [
        SimpleNamespace(**{**r, "outputs": [completion(c) for c in r["outputs"]]}) for r in requests
    ]


def vllm_report(prompts: list[list[int]], groups: list[list[Sample]]) -> list[dict[str, Any]]:
    """JSON `RequestOutput`s for `groups` (one request per prompt, n completions), as vLLM
    reports them with ``logprobs=0``: one {sampled id: Logprob} per position."""
    requests = []
    for i, (prompt, group) in enumerate(zip(prompts, groups, strict=True)):
        outputs = []
        for index, sample in enumerate(group):
            ids, logprobs = sample.token_ids.tolist(), sample.logprobs.tolist()
            outputs.append(
                {
                    "index": index,
                    "text": "",
                    "token_ids": ids,
                    "cumulative_logprob": sum(logprobs),
                    "logprobs": [
                        {str(t): {"logprob": lp, "rank": None, "decoded_token": None}}
                        for t, lp in zip(ids, logprobs, strict=True)
                    ],
                    "finish_reason": sample.finish_reason,
                    "stop_reason": None,
                }
            )
        requests.append(
            {
                "request_id": str(i),
                "prompt": None,
                "prompt_token_ids": prompt,
                "prompt_logprobs": None,
                "finished": True,
                "outputs": outputs,
            }
        )
    return requests


def sglang_report(groups: list[list[Sample]]) -> list[dict[str, Any]]:
    """`Engine.generate`'s list for `groups` (each prompt repeated n times, n=1 each)."""
    outputs = []
    for group in groups:
        for sample in group:
            ids, logprobs = sample.token_ids.tolist(), sample.logprobs.tolist()
            finish = (
                {"type": "stop", "matched": ids[-1]}
                if sample.finish_reason == "stop"
                else {"type": "length", "length": len(ids)}
            )
            outputs.append(
                {
                    "output_ids": ids,
                    "meta_info": {
                        "finish_reason": finish,
                        "prompt_tokens": 0,
                        "completion_tokens": len(ids),
                        "output_token_logprobs": [
                            [lp, t, None] for t, lp in zip(ids, logprobs, strict=True)
                        ],
                    },
                }
            )
    return outputs


def as_plain(groups: list[list[Sample]]) -> list[list[dict[str, Any]]]:
    """Samples as the fixtures' "expected" lists (exact: the values are binary fractions)."""
    return [
        [
            {
                "token_ids": s.token_ids.tolist(),
                "logprobs": s.logprobs.tolist(),
                "finish_reason": s.finish_reason,
            }
            for s in group
        ]
        for group in groups
    ]
