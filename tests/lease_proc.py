"""A stand-in for one colocated role (`tests/test_colocation.py`): it joins the run's members
and takes `count` turns on a device through `consumers.colocation.Phases`, as the rollout
worker and the trainer do. The rollout role generates on a simulated engine with a device
memory in its turns (which refuses to generate while released); the trainer role sleeps.

    python -m tests.lease_proc URL RUN MEMBER_TTL ROLE COUNT SECONDS

Its phases go to `JETRL_PHASE_LOG`; `JETRL_CRASH_AT` arms `<role>.holding_device`.
"""

from __future__ import annotations

import asyncio
import json
import sys

import torch

from bus.connection import connect
from bus.lease import Lease
from bus.membership import Membership, live_members
from bus.topology import Topology
from consumers.colocation import Phases, node_device
from engines.protocols import SamplingParams
from engines.simulated import SimulatedRolloutEngine, SimulatedSettings
from schemas.kv_records import Phase

MEMORY_MIB = 64.0


async def main(url: str, run: str, ttl: float, role: str, count: int, seconds: float) -> None:
    nc = await connect(url, f"lease-proc-{role}")
    js = nc.jetstream()
    topology = Topology(run=run, member_ttl=ttl)
    member = await Membership.join(js, topology, role)
    kv = await js.key_value(topology.kv_bucket)
    members = await js.key_value(topology.members_bucket)
    lease = Lease(kv, members, node_device(), member.key, poll=0.02)
    engine = None
    if role == "rollout":
        settings = SimulatedSettings(
            median_tokens=8, sigma=0.0, seconds_per_token=seconds / 8, memory_mib=MEMORY_MIB
        )
        engine = SimulatedRolloutEngine(torch.nn.Linear(1, 1), 32, 0, settings)
        engine.release_memory()  # as the rollout stage leaves it after building it
    for _ in range(400):  # both roles up before the turns begin (at most 20 s): they contend
        if len({m.role for m in await live_members(js, topology)}) >= 2:
            break
        await asyncio.sleep(0.05)
    phases = Phases(lease, Phase.ROLLOUT if role == "rollout" else Phase.TRAIN, engine)
    for turn in range(count):
        await phases.enter()
        if engine is not None:
            held = engine.device_bytes()
            await asyncio.to_thread(engine.generate, [[1, 2]], 1, SamplingParams(max_tokens=16))
        else:
            held = 0
            await asyncio.sleep(seconds)
        await phases.leave()
        released = 0 if engine is None else engine.device_bytes()
        print(json.dumps({"turn": turn, "held": held, "released": released}), flush=True)
        await asyncio.sleep(seconds / 2)  # between turns: collecting the next work
    await member.leave()
    await nc.close()


if __name__ == "__main__":
    url, run, ttl, role, count, seconds = sys.argv[1:7]
    asyncio.run(main(url, run, float(ttl), role, int(count), float(seconds)))
