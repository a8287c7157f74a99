"""SGLang's own distributed weight update, as `engines.weights_group.GroupWeights` uses it.

Read from SGLang 0.5.23: `Engine.init_weights_update_group(master_address, master_port,
rank_offset, world_size, group_name, backend)` (each TP rank joins as rank_offset + tp_rank,
``srt/model_executor/model_runner_components/weight_updater.py``), `Engine.
update_weights_from_distributed(names, dtypes, shapes, group_name, flush_cache, load_format)`
(one broadcast per tensor from rank 0, received into ``torch.empty(shape, dtype)``, then the
model's `load_weights`), `Engine.destroy_weights_update_group(group_name)`. Each answers
``(success, message)``; a failure is not raised. SGLang 0.5.23 loads weights only inside a
weight-update session (`begin_weight_update` / `end_weight_update`; outside one every update
answers ``(False, "... must run between begin_weight_update() and end_weight_update()")``):
`session` opens one where the engine has the calls (older SGLang has neither).

The read-back: SGLang hands a parameter back only as Python lists (`get_weights_by_name`), so
per bucket of `weight_bucket_bytes` one tensor is read back whole and its sha256 (in the
dtype sent) compared with the manifest's: the smallest of the bucket whose checksum changed
since the last version received this way (a tensor a step left as it was proves nothing),
else the bucket's smallest.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from engines.protocols import WeightsNotLoaded
from engines.weights_group import Spec, sha256_of


def answered(what: str, result: Any) -> None:
    """SGLang's ``(False, message)`` raised as a RuntimeError naming the call."""
    if isinstance(result, Sequence) and len(result) >= 2 and not result[0]:
        raise RuntimeError(f"sglang: {what} failed: {result[1]}")


@contextlib.contextmanager
def session(engine: Any) -> Iterator[None]:
    """A weight-update session around the body, where the engine has one (SGLang 0.5.23)."""
    if not hasattr(engine, "begin_weight_update"):
        yield
        return
    answered("begin_weight_update", engine.begin_weight_update())
    try:
        yield
    finally:
        answered("end_weight_update", engine.end_weight_update())


def _nbytes(spec: Spec) -> int:
    numel = 1
    for d in spec[2]:
        numel *= d
    return numel * torch.empty(0, dtype=getattr(torch, spec[1])).element_size()


def probes(specs: Sequence[Spec], bucket_bytes: int, changed: Mapping[str, bool]) -> list[Spec]:
    """One spec per bucket of at most `bucket_bytes` (a larger tensor alone), in order: the
    smallest whose `changed` is true, else the smallest."""
    buckets: list[list[Spec]] = [[]]
    size = 0
    for spec in specs:
        n = _nbytes(spec)
        if buckets[-1] and size + n > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(spec)
        size += n
    out = []
    for bucket in filter(None, buckets):
        moved = [s for s in bucket if changed.get(s[0], True)] or bucket
        out.append(min(moved, key=_nbytes))
    return out


def read_back(engine: Any, spec: Spec, checksum: str | None) -> None:
    """`spec`'s parameter read back whole (`get_weights_by_name`), in the dtype sent, must hash
    to `checksum`; `WeightsNotLoaded` otherwise."""
    name, dtype, shape = spec
    rows = shape[0] if shape else 1
    got = engine.get_weights_by_name(name, truncate_size=max(1, rows))
    try:
        back = torch.tensor(got, dtype=torch.float32).to(getattr(torch, dtype)).reshape(shape)
    except (TypeError, ValueError, RuntimeError):
        back = None
    if back is None or sha256_of(back) != checksum:
        raise WeightsNotLoaded(f"sglang: {name} reads back unlike its sha256 in the manifest")


def receive(
    engine: Any,
    specs: Sequence[Spec],
    group_name: str,
    checksums: Mapping[str, str],
    bucket_bytes: int,
    previous: Mapping[str, str],
) -> None:
    """`update_weights_from_distributed` of `specs` in a session (the cache flushed), then one
    tensor per bucket read back (`probes`, against `previous`: the checksums of the last
    version received so)."""
    with session(engine):
        result = engine.update_weights_from_distributed(
            names=[s[0] for s in specs],
            dtypes=[s[1] for s in specs],
            shapes=[list(s[2]) for s in specs],
            group_name=group_name,
            flush_cache=True,
        )
    if isinstance(result, Sequence) and len(result) >= 2 and not result[0]:
        raise WeightsNotLoaded(f"sglang: update_weights_from_distributed failed: {result[1]}")
    changed = {name: previous.get(name) != sha for name, sha in checksums.items()}
    for spec in probes(specs, bucket_bytes, changed):
        read_back(engine, spec, checksums.get(spec[0]))
