"""`placement: colocated`: the device lease (`bus.lease`) and the phases on it
(`consumers.colocation`), on a real nats-server with real processes.

- the lease's decision, case by case (pure);
- phase exclusion: a rollout role and a trainer role, two processes, take turns on one
  device; from the recorded timeline of phase starts and ends, no phase starts while the
  other holds the device, and the rollout's simulated engine holds its memory only in its
  turns (it refuses to generate while released);
- fencing: a holder whose lease was taken over (paused past the members TTL, counted dead)
  computes nothing more: its next `enter` gives the engine's memory back and waits for the
  device, which it holds again only once the new holder has left;
- a kill -9 in each phase: the holder dies holding the device (crash point
  `<role>.holding_device`); the other role takes it over once the dead one's membership
  expires (not before: the timeline still never overlaps), the killed role restarts and
  finishes all its turns.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from bus.connection import connect
from bus.crashpoints import CRASH_AT, CRASH_RECORD, records
from bus.embedded import EmbeddedNats
from bus.lease import Lease, Verdict, decide, hand_over
from bus.topology import Topology
from consumers.colocation import PHASE_LOG, Phases
from engines.protocols import SamplingParams
from engines.simulated import SimulatedRolloutEngine, SimulatedSettings
from producers.stall import diagnose, lease_lines
from producers.stall_view import RunView, read_view
from schemas.config import ConfigError, parse_config
from schemas.kv_records import DeviceLease, Member, Phase
from tests.phase_timeline import assert_exclusive, phase_intervals, read_timeline

TTL = 1.0
"""The members bucket's TTL here: a killed holder's lease is free after it."""
TURNS = 4
SECONDS = 0.2
MIB = 1 << 20


def test_the_lease_decision() -> None:
    held = DeviceLease(holder="a", phase=Phase.ROLLOUT, since=time.time())
    assert decide(None, "b", True).verdict is Verdict.TAKE
    assert decide(held, "a", True).verdict is Verdict.MINE
    assert decide(held, "b", True).verdict is Verdict.WAIT
    assert decide(held, "b", False).verdict is Verdict.TAKE  # its holder is dead
    free = held.model_copy(update={"holder": None, "wanted": Phase.TRAIN, "wanted_by": "b"})
    assert decide(free, "a", True, wanter_alive=True).verdict is Verdict.WAIT  # promised to b
    assert decide(free, "a", True, wanter_alive=False).verdict is Verdict.TAKE
    assert decide(free, "b", True).verdict is Verdict.TAKE
    wanted = held.model_copy(update={"wanted": Phase.TRAIN, "wanted_by": "b"})
    assert hand_over(wanted, "a") and not hand_over(held, "a") and not hand_over(wanted, "b")


COLOCATED: dict[str, Any] = {
    "placement": "colocated",
    "rollout": {"engine": "simulated", "continuous": False},
}


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (
            {
                "rollout": {
                    "engine": {"type": "vllm", "tensor_parallel_size": 2},
                    "continuous": False,
                }
            },
            "not vllm over 2 tensor-parallel ranks",
        ),
        (
            {"rollout": {"engine": {"type": "sglang", "tp_size": 4}, "continuous": False}},
            "not sglang over 4 tensor-parallel ranks",
        ),
        ({"trainer": {"engine": "fsdp"}}, "needs trainer.engine torch with dp_size 1"),
        (
            {"rollout": {"engine": "simulated", "continuous": False, "engine_copies": 2}},
            "needs rollout.engine_copies 1",
        ),
        ({"rollout": {"engine": "simulated"}}, "needs rollout.continuous false"),
        ({"weights": {"transport": "collective"}}, "not collective"),
    ],
)
def test_what_colocation_cannot_do_is_refused_in_one_line(
    change: dict[str, Any], said: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        parse_config({**COLOCATED, **change})
    assert said in str(refused.value) and "\n" not in str(refused.value)
    assert parse_config(COLOCATED).placement == "colocated"
    assert parse_config({}).placement == "separated"  # the default: nothing changes


def test_offloading_the_optimizer_is_refused_unless_colocated() -> None:
    """Separated, the trainer never gives its device back: moving its optimizer state off and
    on each step would only slow it."""
    offload = {"trainer": {"offload_optimizer": True}}
    with pytest.raises(ConfigError) as refused:
        parse_config(offload)
    said = str(refused.value)
    assert "trainer.offload_optimizer needs placement colocated, not separated" in said, said
    assert "\n" not in said
    assert parse_config({**COLOCATED, **offload}).trainer.offload_optimizer
    assert not parse_config(COLOCATED).trainer.offload_optimizer  # the default: kept on device


@pytest.mark.parametrize("engine", ["simulated", "hf", "vllm", "sglang"])
def test_every_rollout_engine_with_its_release_wired_may_run_colocated(engine: str) -> None:
    config = parse_config({**COLOCATED, "rollout": {"engine": engine, "continuous": False}})
    assert config.placement == "colocated" and config.rollout.engine.type == engine


def test_the_simulated_engine_holds_its_memory_only_awake() -> None:
    settings = SimulatedSettings(median_tokens=2, sigma=0.0, seconds_per_token=0.0, memory_mib=8)
    engine = SimulatedRolloutEngine(torch.nn.Linear(1, 1), 32, 0, settings)
    params = SamplingParams(max_tokens=4)
    assert engine.device_bytes() == 8 * MIB
    engine.release_memory()
    assert engine.device_bytes() == 0
    with pytest.raises(RuntimeError, match="released"):
        engine.generate([[1]], 1, params)
    with pytest.raises(RuntimeError, match="released"):
        engine.generate_sample([1], params)
    engine.resume_memory()
    assert engine.device_bytes() == 8 * MIB and len(engine.generate([[1]], 2, params)[0]) == 2


def test_a_released_device_goes_to_the_waiter_and_a_dead_holders_to_the_next(
    nats_server: EmbeddedNats,
) -> None:
    """On the bus, in one process: the holder hands over to the process that waits (it does not
    take the device straight back), and a holder whose member entry is gone holds nothing."""
    topology = Topology(run=f"t{uuid.uuid4().hex[:10]}", member_ttl=30.0)

    async def main() -> None:
        nc = await connect(nats_server.url, "test-lease")
        js = nc.jetstream()
        await topology.apply(js)
        try:
            kv = await js.key_value(topology.kv_bucket)
            members = await js.key_value(topology.members_bucket)
            for key, role in (("a", "rollout"), ("b", "trainer")):  # alive: the entry is there
                member = Member(role=role, node="node", pid=1, started_at=0.0, updated_at=0.0)
                await members.put(key, member.encode())
            a, b = (Lease(kv, members, "node/0", key, poll=0.02) for key in ("a", "b"))
            await a.acquire(Phase.ROLLOUT)
            waiting = asyncio.create_task(b.acquire(Phase.TRAIN))
            for _ in range(250):
                if await a.wanted():
                    break
                await asyncio.sleep(0.02)
            assert await a.wanted(), "b waits, yet a is not told"
            await a.release()
            again = asyncio.create_task(a.acquire(Phase.ROLLOUT))
            done, _ = await asyncio.wait({waiting, again}, return_when=asyncio.FIRST_COMPLETED)
            assert done == {waiting}, "a took back the device b was waiting for"
            await members.delete("b")  # b is gone (killed: its entry expired)
            taken, _ = await asyncio.wait({again}, timeout=5.0)
            assert taken == {again}, "the device of a holder that is gone was not taken over"
            record, _ = await a.read()
            assert record is not None and (record.holder, record.phase) == ("a", Phase.ROLLOUT)
            seen = await read_view(js, topology, parse_config({**COLOCATED, "run": topology.run}))
            assert seen.leases is not None and seen.leases["lease.node_0"].holder == "a"
        finally:
            await topology.delete(js)
            await nc.close()

    asyncio.run(main())


def test_a_holder_whose_lease_was_taken_over_is_fenced(nats_server: EmbeddedNats) -> None:
    """The rollout holds the device across batches; paused past the members TTL (its entry
    gone), the trainer takes the device over. When the rollout wakes (its entry back) and
    enters for its next batch, it must not compute: its engine gives its memory back and it
    waits until the trainer leaves."""
    topology = Topology(run=f"t{uuid.uuid4().hex[:10]}", member_ttl=30.0)
    settings = SimulatedSettings(median_tokens=2, sigma=0.0, seconds_per_token=0.0, memory_mib=8)
    engine = SimulatedRolloutEngine(torch.nn.Linear(1, 1), 32, 0, settings)

    async def main() -> None:
        nc = await connect(nats_server.url, "test-fence")
        js = nc.jetstream()
        await topology.apply(js)
        try:
            kv = await js.key_value(topology.kv_bucket)
            members = await js.key_value(topology.members_bucket)
            member = Member(role="rollout", node="node", pid=1, started_at=0.0, updated_at=0.0)
            for key in ("a", "b"):
                await members.put(key, member.encode())
            rollout = Phases(Lease(kv, members, "node/0", "a", poll=0.02), Phase.ROLLOUT, engine)
            trainer = Phases(Lease(kv, members, "node/0", "b", poll=0.02), Phase.TRAIN)
            await rollout.enter()
            assert engine.device_bytes() == 8 * MIB
            await members.delete("a")  # paused past the TTL: counted dead
            await asyncio.wait_for(trainer.enter(), 5.0)  # taken over
            await members.put("a", member.encode())  # it wakes: its heartbeat is back
            next_batch = asyncio.create_task(rollout.enter())
            done, _ = await asyncio.wait({next_batch}, timeout=0.5)
            assert not done, "the rollout went on computing on a device the trainer holds"
            assert engine.device_bytes() == 0, "a fenced engine kept its device memory"
            await trainer.leave()
            await asyncio.wait_for(next_batch, 5.0)
            record, _ = await rollout.lease.read()
            assert record is not None and record.holder == "a"
            assert engine.device_bytes() == 8 * MIB  # its turn again: memory taken again
        finally:
            await topology.delete(js)
            await nc.close()

    asyncio.run(main())


def test_a_stalled_colocated_run_names_who_holds_the_device() -> None:
    view = RunView(
        parse_config(COLOCATED),
        None,
        {},
        None,
        {},
        None,
        None,
        None,
        leases={
            "lease.vm_0": DeviceLease(
                holder="vm_12_rollout",
                phase=Phase.ROLLOUT,
                since=100.0,
                wanted=Phase.TRAIN,
                wanted_by="vm_13_trainer",
            )
        },
    )
    assert lease_lines(view.leases or {}, 160.0) == [
        "device vm_0 is held by vm_12_rollout in its rollout phase for 60s; "
        "vm_13_trainer waits for it (train)"
    ]
    assert any("held by vm_12_rollout" in line for line in diagnose(view))


def test_a_phase_never_starts_while_the_other_holds_the_device(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    timeline, outputs = run_roles(nats_server.url, tmp_path, crash=None)
    intervals = phase_intervals(timeline, {})
    assert_exclusive(intervals)
    ends = [line for line in timeline if line["event"] == "end"]
    assert sorted(p["phase"] for p in ends) == ["rollout"] * TURNS + ["train"] * TURNS
    # The rollout's engine held its memory in each of its turns, and none after it.
    turns = [json.loads(line) for line in outputs["rollout"].splitlines()]
    assert [(t["held"], t["released"]) for t in turns] == [(64 * MIB, 0)] * TURNS


@pytest.mark.parametrize("role", ["rollout", "trainer"])
def test_a_kill_in_each_phase_recovers(
    nats_server: EmbeddedNats, tmp_path: Path, role: str
) -> None:
    timeline, _ = run_roles(nats_server.url, tmp_path, crash=role)
    fired = records(tmp_path / "crashes")
    assert list(fired) == [f"{role}.holding_device"], fired
    record: dict[str, Any] = fired[f"{role}.holding_device"]
    killed_at, killed_pid = float(record["time"]), int(record["pid"])
    intervals = phase_intervals(timeline, {killed_pid: killed_at})
    assert_exclusive(intervals)
    # The device was taken again after the kill, and not only once the whole TTL had
    # passed many times over (the dead holder's lease ended with its membership).
    after = [start for start, _, _ in intervals if start > killed_at]
    assert after and min(after) - killed_at < TTL + 10.0, (killed_at, after[:3])
    # Both roles finished every turn: the killed one in its restarted process.
    phase = "rollout" if role == "rollout" else "train"
    ends = [line for line in timeline if line["event"] == "end"]
    survivors = [p for p in ends if p["pid"] != killed_pid]
    assert sum(p["phase"] == phase for p in survivors) == TURNS
    assert sum(p["phase"] != phase for p in survivors) == TURNS


def run_roles(
    url: str, tmp_path: Path, crash: str | None
) -> tuple[list[dict[str, Any]], dict[str, str]]:
    """Run a rollout and a trainer role to the end of their turns (restarting one killed once);
    the phase timeline (each line with its process's pid) and each role's last output."""
    topology = Topology(run=f"t{uuid.uuid4().hex[:10]}", member_ttl=TTL)
    asyncio.run(declare(url, topology))
    log = tmp_path / "phases.jsonl"
    env = {**os.environ, PHASE_LOG: str(log), CRASH_RECORD: str(tmp_path / "crashes")}
    try:
        procs = {role: start(url, topology, role, env, crash) for role in ("rollout", "trainer")}
        outputs: dict[str, str] = {}
        deadline = time.monotonic() + 180
        while procs:
            assert time.monotonic() < deadline, f"roles still running: {list(procs)}"
            for role, proc in list(procs.items()):
                code = proc.poll()
                if code is None:
                    continue
                out = proc.stdout.read() if proc.stdout else ""
                if code == -signal.SIGKILL and role == crash:  # the supervisor restarts it
                    procs[role] = start(url, topology, role, env, crash)
                    continue
                assert code == 0, f"{role} exited {code}"
                outputs[role] = out
                del procs[role]
            assert_taken_over(log, tmp_path / "crashes")
            time.sleep(0.1)
    finally:
        asyncio.run(delete(url, topology))
    return read_timeline(log), outputs


TAKE_OVER = TTL + 15.0
"""Seconds after a kill by which the device must have been taken again (the members TTL, and
room for a loaded machine)."""


def assert_taken_over(log: Path, crashes: Path) -> None:
    """Once a holder was killed: fail as soon as `TAKE_OVER` s pass with no phase started
    since (its lease outlived it), rather than wait for the roles' deadline."""
    for record in records(crashes).values():
        killed_at = float(record["time"])  # type: ignore[arg-type]
        if time.time() - killed_at < TAKE_OVER:
            return
        starts = [json.loads(line) for line in log.read_text().splitlines()]
        assert any(s["event"] == "start" and s["t"] > killed_at for s in starts), (
            f"no phase started in the {TAKE_OVER:.0f} s since the holder was killed: "
            "its lease outlived it"
        )


def start(
    url: str, topology: Topology, role: str, env: dict[str, str], crash: str | None
) -> subprocess.Popen[str]:
    armed = {**env, CRASH_AT: f"{role}.holding_device@2"} if role == crash else env
    command = [sys.executable, "-m", "tests.lease_proc", url, topology.run, str(TTL), role]
    return subprocess.Popen(
        [*command, str(TURNS), str(SECONDS)], env=armed, stdout=subprocess.PIPE, text=True
    )


async def declare(url: str, topology: Topology) -> None:
    nc = await connect(url, "test-colocation")
    await topology.apply(nc.jetstream())
    await nc.close()


async def delete(url: str, topology: Topology) -> None:
    nc = await connect(url, "test-colocation")
    await topology.delete(nc.jetstream())
    await nc.close()
