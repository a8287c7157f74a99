"""`python -m ops.bench.codec [--quick]`: encode + decode and validation of each data event.

For trajectories (one turn; an episode with a response mask), rewards (with reference
log-probs; with turn rewards too) and batches (8 rows; with token rewards too) of 1k, 4k and
16k tokens: microseconds per encode + decode to a validated event (`codec_us`), per pydantic
validation of the wire map (`validate_us`: field types, nested tensors, the poison checks of
`schemas.events`), and, for rewards, per `RewardEvent(...)` built from a validated trajectory,
as the reward worker does (`build_us`); the baseline, a bare msgpack pack + unpack of the same
wire map (`bare_msgpack_us`), and `ratio`, the lowest of bare / ours. Each the best of 5 runs,
in this thread's CPU time (on shared cores the wall clock counts the other jobs' turns too).
`ops.bench.bus` has the trajectory's figures against the bus.
"""

from __future__ import annotations

import argparse
import json
import time
import timeit
from collections.abc import Callable

import msgpack
import numpy as np

from schemas import BatchEvent, Event, RewardEvent, Tensor, TrajectoryEvent, decode, encode
from tests.helpers import trajectory

SIZES = (1024, 4096, 16384)


def episode(tokens: int, masked: bool) -> TrajectoryEvent:
    """The bench trajectory; `masked`: ten environment tokens in the middle (two model turns)."""
    t = trajectory("bench", prompt=1, tokens=tokens)
    if not masked:
        return t
    mask = np.ones(tokens, np.uint8)
    mask[tokens // 2 : tokens // 2 + 10] = 0
    return TrajectoryEvent.model_validate(
        {
            **dict(t),
            "response_mask": Tensor.from_numpy(mask),
            "logprobs": Tensor.from_numpy(np.where(mask == 1, -1.5, 0.0).astype(np.float32)),
            "versions": Tensor.from_numpy(np.where(mask == 1, 0, -1).astype(np.int32)),
        }
    )


def reward(tokens: int, turns: bool) -> RewardEvent:
    t = episode(tokens, masked=turns)
    return RewardEvent(
        id=t.id,
        run="bench",
        trajectory=t,
        reward=1.0,
        ref_logprobs=Tensor.from_numpy(np.full(tokens, -1.0, np.float32)),
        turn_rewards=Tensor.from_numpy(np.array([0.5, 0.0], np.float32)) if turns else None,
    )


def batch(tokens: int, token_rewards: bool, rows: int = 8) -> BatchEvent:
    """`tokens` in all: `rows` rows of tokens / rows, the first 16 of each off the loss mask."""
    shape = (rows, tokens // rows)
    loss = np.ones(shape, np.uint8)
    loss[:, :16] = 0
    logprobs = Tensor.from_numpy(np.where(loss == 1, -1.0, 0.0).astype(np.float32))
    placed = np.zeros(shape, np.float32)
    placed[:, -1] = 0.5
    return BatchEvent(
        id="bench/step/4/0/0",
        run="bench",
        step=4,
        dp_rank=0,
        dp_size=1,
        micro_index=0,
        micro_count=1,
        input_ids=Tensor.from_numpy(np.arange(tokens, dtype=np.int32).reshape(shape) % 1000),
        attention_mask=Tensor.from_numpy(np.ones(shape, np.uint8)),
        loss_mask=Tensor.from_numpy(loss),
        advantages=Tensor.from_numpy(np.ones(rows, np.float32)),
        behaviour_logprobs=logprobs,
        versions=Tensor.from_numpy(np.where(loss == 1, 3, -1).astype(np.int32)),
        rewards=Tensor.from_numpy(np.ones(rows, np.float32)),
        sample_ids=tuple(f"bench/0/{i}/0" for i in range(rows)),
        ref_logprobs=logprobs,
        token_rewards=Tensor.from_numpy(placed) if token_rewards else None,
    )


def best_us(fn: Callable[[], object], number: int) -> float:
    runs = timeit.repeat(fn, number=number, repeat=5, timer=time.thread_time)
    return round(min(runs) / number * 1e6, 1)


def figures(event: Event, number: int) -> dict[str, float]:
    cls, wire = type(event), event.model_dump()
    out = {
        "codec_us": best_us(lambda: decode(encode(event), cls), number),
        "validate_us": best_us(lambda: cls.model_validate(wire), number),
        "bare_msgpack_us": best_us(lambda: msgpack.unpackb(msgpack.packb(wire)), number),
    }
    if isinstance(event, RewardEvent):
        t, kept = event.trajectory, {"ref_logprobs", "turn_rewards"}
        fields = {k: v for k, v in dict(event).items() if k in kept}

        def build() -> RewardEvent:
            return RewardEvent(id=t.id, run=t.run, trajectory=t, reward=1.0, **fields)

        out["build_us"] = best_us(build, number)
    return out


def main(quick: bool) -> dict:
    number = 300 if quick else 2000
    makers: dict[str, Callable[[int], Event]] = {
        "trajectory": lambda n: episode(n, masked=False),
        "trajectory_masked": lambda n: episode(n, masked=True),
        "reward": lambda n: reward(n, turns=False),
        "reward_turns": lambda n: reward(n, turns=True),
        "batch": lambda n: batch(n, token_rewards=False),
        "batch_token_rewards": lambda n: batch(n, token_rewards=True),
    }
    result: dict[str, dict[str, dict[str, float]]] = {}
    for name, make in makers.items():
        result[name] = {str(n): figures(make(n), number) for n in SIZES}
        print(f"{name:>20}: {result[name]}", flush=True)
    ratio = min(f["bare_msgpack_us"] / f["codec_us"] for e in result.values() for f in e.values())
    return {"bench": "codec", "quick": quick, "events": result, "ratio": round(ratio, 3)}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        prog="python -m ops.bench.codec", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="fewer calls (about 20 s)")
    print(json.dumps(main(parser.parse_args().quick)))
