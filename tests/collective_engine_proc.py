"""A rollout worker's side of tests/test_collective_engine.py, one process per worker (a
process holds one rank of a named group, as an engine's scheduler does).

The worker builds its engine (`hf`: our HF engine, which receives into its own parameters;
`sglang`: the real SGLang batch adapter over the stand-in `sglang.Engine`, whose
`init_weights_update_group` / `update_weights_from_distributed` join and receive as SGLang's
do), says `<member>.ready`, then for each version the test writes (`event<v>.json`) takes it
as the rollout stage does: `CollectiveTransport.into_engines`, and the returned fallback
copy (if any) loaded whole. It writes `<member>-v<v>.pt`: whether the copy was loaded, and
the engine's parameters after it.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

from bus.connection import connect
from consumers.weights import transport_for
from consumers.weights.collective import CollectiveTransport
from schemas.config import WeightsConfig
from schemas.weight_event import WeightVersionEvent

SETTINGS = {
    "transport": "collective",
    "collective": {"join_timeout_s": 20, "op_timeout_s": 10, "bucket_mib": 1, "max_attempts": 2},
}


def engine_of(kind: str, model_dir: str) -> tuple[Any, torch.nn.Module, Any]:
    """(the rollout engine, the module whose parameters it serves, the stand-in or None)."""
    if kind == "hf":
        from engines.hf_rollout import HFRolloutEngine

        hf = HFRolloutEngine(Path(model_dir))
        return hf, hf.model, None
    from tests.engine_standins import sglang_modules

    sys.modules.update(sglang_modules())
    from engines.sglang_rollout import SGLangRolloutEngine

    adapter = SGLangRolloutEngine(Path(model_dir))
    return adapter, adapter.engine.hf.model, adapter.engine


def worker_main(
    member: str, kind: str, model_dir: str, url: str, run: str, bucket: str, out: str, faults: str
) -> None:
    """`faults`: JSON {version: {"break_at": i} | {"skip": [name]}} for the SGLang stand-in."""
    torch.set_num_threads(1)
    asyncio.run(serve(member, kind, model_dir, url, run, bucket, Path(out), json.loads(faults)))


async def serve(
    member: str, kind: str, model_dir: str, url: str, run: str, bucket: str, out: Path,
    faults: dict[str, dict],
) -> None:  # fmt: skip
    engine, module, standin = engine_of(kind, model_dir)
    nc = await connect(url, member)
    config = WeightsConfig.model_validate(SETTINGS)
    transport = transport_for(config, nc.jetstream(), bucket, run, "collective", member_id=member)
    assert isinstance(transport, CollectiveTransport)
    (out / f"{member}.ready").touch()
    for v in (1, 2, 3):
        path = out / f"event{v}.json"
        while not path.exists():
            await asyncio.sleep(0.05)
        event = WeightVersionEvent.model_validate_json(path.read_text())
        fault = faults.get(str(v), {})
        if standin is not None:
            standin.break_at = fault.get("break_at")
            standin.skip = set(fault.get("skip", ()))
        started = time.monotonic()
        fallback = await transport.into_engines(event, [engine])
        if fallback is not None:  # as the rollout stage does: the stored copy, whole
            if standin is not None:
                standin.skip = set()
            await asyncio.to_thread(engine.load_state_dict, fallback, v)
        params = {n: p.detach().clone() for n, p in module.named_parameters()}
        record = {
            "fallback": fallback is not None,
            "version": engine.version,
            "seconds": time.monotonic() - started,
            "params": params,
        }
        torch.save(record, out / f"{member}-v{v}.pt")
    await transport.close()
    await nc.close()
