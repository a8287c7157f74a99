"""The HF rollout engine gives its memory back between colocated phases, on the CPU, shown by
what the process holds (issue 30), and loads on resume the weights that came while it slept.

On the CPU "off the device" can only mean that the weights' bytes leave the process
(`engines.release.Offload`: spilled to an unlinked file, their storages freed), so the
measure is the process's resident set (VmRSS, /proc/self/status): during the trainer's phase
it must be lower by about the weights' bytes than in the rollout's. The phases are the real
ones (`consumers.colocation.Phases` on a `bus.lease.Lease`, a real nats-server); the engine
is a real HF Qwen2 of ~60 MiB of float32 weights, large enough to stand above the noise of
the allocator and the other threads of the test process.

The weights watcher loads from its own thread while the phase's thread releases and resumes:
a race between the two, run in a child process (`tests.release_race`), must lose no load and
never fault.

The torch train engine gives its optimizer state back the same way (`trainer.offload_optimizer`,
`TorchTrainEngine.release_optimizer`): the resident set drops by the state's bytes, and
training through a release and resume between each step is bit-identical to training without,
a restore from a checkpoint included.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch

from bus.connection import connect
from bus.embedded import EmbeddedNats
from bus.lease import Lease
from bus.topology import Topology
from consumers.colocation import Phases
from engines.hf_rollout import HFRolloutEngine
from engines.protocols import (
    ReleasableEngine,
    ReleasableTrainEngine,
    Sample,
    SamplingParams,
)
from engines.torch_train import TorchTrainEngine
from schemas.kv_records import Member, Phase
from tests.test_activation_checkpointing import micro_batch

MIB = 1 << 20
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
PROMPTS = [[1, 2, 3], [4, 5]]
RELEASED_SHARE = 0.8
"""Of the weights' bytes, the least share the resident set must drop by while released (it
dropped by 100% of them, 60.1 of 60.1 MiB, on every cycle measured here)."""


def resident_bytes() -> int:
    """This process's anonymous memory, resident or swapped (RssAnon + VmSwap of
    /proc/self/status), in bytes. Not VmRSS: it counts file-backed pages too (libtorch's
    mapped libraries alone are hundreds of MiB), which the kernel evicts and reads back under
    page-cache pressure; on a loaded CI machine VmRSS rose by 8 MiB over a 60 MiB resume."""
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "VmSwap"):
            fields[key] = int(value.split()[0]) * 1024
    assert "RssAnon" in fields, "no RssAnon in /proc/self/status"
    return sum(fields.values())


@pytest.fixture(scope="module")
def sized_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-init Qwen2 with ~60 MiB of float32 weights (hidden 512, 4 layers)."""
    from engines.tiny import build_tiny_model
    from producers.tasks import VOCAB

    return build_tiny_model(tmp_path_factory.mktemp("sized"), VOCAB, hidden=512, layers=4)


def test_the_hf_engine_gives_its_memory_back_between_phases(
    nats_server: EmbeddedNats, sized_model: Path
) -> None:
    """Rollout phase, trainer phase, rollout phase, twice: in each trainer phase the process
    holds about the weights' bytes less than in the rollout phase before it, the engine
    refuses to generate, and a version loaded meanwhile is what it generates with after."""
    engine = HFRolloutEngine(sized_model)
    assert isinstance(engine, ReleasableEngine)
    weights = engine.device_bytes()
    assert weights > 50 * MIB, weights
    first = engine.generate(PROMPTS, 1, GREEDY)
    # One release and resume before measuring: from_pretrained may leave the weights in the
    # checkpoint's memory map (file-backed, not counted above); the first release gives each
    # storage a copy of its own (`Offload.own_storages`), anonymous from then on.
    engine.release_memory()
    engine.resume_memory()
    topology = Topology(run=f"t{uuid.uuid4().hex[:10]}", member_ttl=30.0)

    async def main() -> list[tuple[int, int, int]]:
        nc = await connect(nats_server.url, "test-release")
        js = nc.jetstream()
        await topology.apply(js)
        try:
            kv = await js.key_value(topology.kv_bucket)
            members = await js.key_value(topology.members_bucket)
            for key, role in (("r", "rollout"), ("t", "trainer")):
                member = Member(role=role, node="node", pid=1, started_at=0.0, updated_at=0.0)
                await members.put(key, member.encode())
            rollout = Phases(Lease(kv, members, "node/0", "r", poll=0.02), Phase.ROLLOUT, engine)
            trainer = Phases(Lease(kv, members, "node/0", "t", poll=0.02), Phase.TRAIN)
            return await cycles(engine, rollout, trainer, first)
        finally:
            await topology.delete(js)
            await nc.close()

    for held, released, again in asyncio.run(main()):
        print(
            f"resident: rollout {held / MIB:.1f} MiB, train {released / MIB:.1f} MiB, "
            f"rollout again {again / MIB:.1f} MiB (weights {weights / MIB:.1f} MiB)"
        )
        assert held - released >= RELEASED_SHARE * weights, (held, released, weights)
        assert again - released >= RELEASED_SHARE * weights, (released, again, weights)


async def cycles(
    engine: HFRolloutEngine,
    rollout: Phases,
    trainer: Phases,
    first: list[list[Sample]],
) -> list[tuple[int, int, int]]:
    """Two rounds of rollout / train / rollout; the resident set in each."""
    original = {name: p.detach().clone() for name, p in engine.model.named_parameters()}
    name = "model.layers.0.mlp.down_proj.weight"
    measured = []
    for version in (1, 2):
        await rollout.enter()
        await asyncio.to_thread(engine.generate, PROMPTS, 1, GREEDY)
        held = resident_bytes()
        await rollout.leave()
        await trainer.enter()
        released = resident_bytes()
        assert engine.device_bytes() == 0
        with pytest.raises(RuntimeError, match="released"):
            engine.generate(PROMPTS, 1, GREEDY)
        # A version arrives while the trainer holds the device: kept, loaded on resume.
        engine.load_state_dict({name: original[name] * (version + 1)}, version=version)
        assert engine.version == version and engine.device_bytes() == 0
        await trainer.leave()
        await rollout.enter()
        again = resident_bytes()
        params = dict(engine.model.named_parameters())
        assert torch.equal(params[name], original[name] * (version + 1)), "not loaded on wake"
        others = [n for n in original if n != name]
        assert all(torch.equal(params[n], original[n]) for n in others), "changed in release"
        measured.append((held, released, again))
    engine.load_state_dict({name: original[name]}, version=3)
    assert [[s.token_ids.tolist() for s in g] for g in engine.generate(PROMPTS, 1, GREEDY)] == [
        [s.token_ids.tolist() for s in g] for g in first
    ], "the weights came back otherwise than they left"
    await rollout.leave()
    return measured


def test_a_load_while_released_keeps_the_bytes_it_was_given(model_dir: Path) -> None:
    """The weights receiver changes a delta chain's tensors in place for the next version once
    a load returns: what a released engine loads on resume is the bytes of the version it was
    given, not what the caller's tensors hold by then."""
    engine = HFRolloutEngine(model_dir)
    name = "model.norm.weight"
    sent = torch.full_like(dict(engine.model.named_parameters())[name], 0.5)
    engine.release_memory()
    engine.load_state_dict({name: sent}, version=1)
    sent.add_(1.0)  # the receiver brings its copy to v2 in place
    engine.resume_memory()
    held = dict(engine.model.named_parameters())[name]
    assert torch.equal(held, torch.full_like(held, 0.5)), "loaded what the caller changed later"


def test_a_load_while_released_refuses_unknown_names_at_once(model_dir: Path) -> None:
    engine = HFRolloutEngine(model_dir)
    engine.release_memory()
    engine.release_memory()  # twice: nothing more
    with pytest.raises(KeyError, match="does not have"):
        engine.load_state_dict({"no.such.weight": torch.zeros(1)}, version=1)
    assert engine.version == 0
    engine.resume_memory()
    engine.resume_memory()  # twice: nothing more
    assert engine.device_bytes() > 0 and engine.generate([[1, 2]], 2, GREEDY)


def test_loads_from_another_thread_never_meet_a_release_halfway(model_dir: Path) -> None:
    """The rollout worker loads each version from its weights watcher's thread while the
    phase's thread may be releasing or resuming the engine: every load must land whole, held
    or deferred, never into storages being freed (which faults: hence a child process, whose
    death by a signal fails the test by name)."""
    loads = 100
    child = subprocess.run(
        [sys.executable, "-m", "tests.release_race", str(model_dir), str(loads)],
        cwd=Path(__file__).resolve().parent.parent,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert child.returncode == 0, (child.returncode, child.stderr[-1500:])
    result = json.loads(child.stdout.strip().splitlines()[-1])
    assert result == {"version": loads, "loaded": True}, result


def state_bytes(engine: TorchTrainEngine) -> int:
    """Bytes of the storages of every tensor in the optimizer's state now (AdamW's moments and
    step counters; 0 while released)."""
    state = [v for s in engine.optimizer.state.values() for v in s.values()]
    assert all(isinstance(v, torch.Tensor) for v in state), "AdamW's state is all tensors"
    return sum(v.untyped_storage().nbytes() for v in state)


def test_the_torch_engine_gives_its_optimizer_state_back(sized_model: Path) -> None:
    """After a step the AdamW state (two moments of the ~60 MiB of float32 weights, and the
    step counters) leaves the process on `release_optimizer`: the resident set drops by about
    its bytes, and rises by them again on `resume_optimizer`; no step may run meanwhile."""
    engine = TorchTrainEngine(sized_model, lr=1e-3)
    assert isinstance(engine, ReleasableTrainEngine)
    assert engine.release_optimizer() == 0 and not engine.optimizer_offload.released  # no state
    engine.train_step([micro_batch(0)])
    state = state_bytes(engine)
    weights = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    assert state >= 2 * weights > 100 * MIB, (state, weights)
    for _ in range(2):
        held = resident_bytes()
        started = time.perf_counter()
        released = engine.release_optimizer()
        release_seconds = time.perf_counter() - started
        dropped = resident_bytes()
        assert state_bytes(engine) == 0, "a state tensor kept its storage"
        with pytest.raises(RuntimeError, match="released"):
            engine.train_step([micro_batch(1)])
        started = time.perf_counter()
        resumed = engine.resume_optimizer()
        resume_seconds = time.perf_counter() - started
        again = resident_bytes()
        print(
            f"optimizer state {state / MIB:.1f} MiB: resident {held / MIB:.1f} MiB, released "
            f"{dropped / MIB:.1f} MiB ({release_seconds:.3f} s), resumed {again / MIB:.1f} MiB "
            f"({resume_seconds:.3f} s)"
        )
        assert released == resumed == state == state_bytes(engine)
        assert held - dropped >= RELEASED_SHARE * state, (held, dropped, state)
        assert again - dropped >= RELEASED_SHARE * state, (dropped, again, state)


def test_training_through_releases_is_bit_identical(model_dir: Path, tmp_path: Path) -> None:
    """Three steps with the optimizer state released and resumed after each (a checkpoint
    saved before the release, as the trainer does) give the very parameters and state of three
    steps without; so does a restart from the first step's checkpoint that releases and
    resumes after its load and after each step, as a restarted colocated trainer does."""
    batches = [[micro_batch(seed)] for seed in range(3)]
    plain = TorchTrainEngine(model_dir, lr=1e-2)
    offloaded = TorchTrainEngine(model_dir, lr=1e-2)
    checkpoint = tmp_path / "rank0.pt"
    for index, batch in enumerate(batches):
        plain.train_step(batch)
        offloaded.train_step(batch)
        if index == 0:
            offloaded.save_checkpoint(checkpoint)
        assert offloaded.release_optimizer() > 0 and state_bytes(offloaded) == 0
        with pytest.raises(RuntimeError, match="released"):
            offloaded.save_checkpoint(tmp_path / "refused.pt")
        offloaded.resume_optimizer()
    restored = TorchTrainEngine(model_dir, lr=1e-2, seed=1)
    restored.load_checkpoint(checkpoint)
    assert restored.step == 1
    for batch in batches[1:]:
        assert restored.release_optimizer() > 0
        restored.resume_optimizer()
        restored.train_step(batch)
    for engine in (offloaded, restored):
        assert_same_training(plain, engine)


def assert_same_training(expected: TorchTrainEngine, got: TorchTrainEngine) -> None:
    """The same step, parameters and optimizer state, bit for bit."""
    assert got.step == expected.step
    mine = dict(got.model.named_parameters())
    for name, param in expected.model.named_parameters():
        assert torch.equal(mine[name], param), f"{name} differs"
    theirs, ours = expected.optimizer.state_dict()["state"], got.optimizer.state_dict()["state"]
    assert theirs.keys() == ours.keys()
    for index, state in theirs.items():
        for key, value in state.items():
            assert torch.equal(ours[index][key], value), f"optimizer state {index}.{key} differs"
