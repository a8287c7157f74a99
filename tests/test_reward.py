"""The reward pool against misbehaving functions, and the reward worker against a real
nats-server."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from nats.js import JetStreamContext

from bus.connection import connect
from bus.embedded import EmbeddedNats
from bus.lag import queue_lag
from bus.publisher import Publisher
from bus.runtime import attach, publish_config
from bus.stage import serve
from bus.topology import REWARDS, TRAJECTORIES, Topology
from consumers import reward as reward_stage
from consumers.reward_pool import Limits, RewardPool, RewardSpecError, Score
from consumers.reward_sandbox import Isolation
from schemas import RewardEvent, TrajectoryEvent, decode
from schemas.config import DataConfig, RewardConfig, RunConfig
from tests import reward_fns
from tests.helpers import dead_letters, messages, trajectory, wait_for

ROOT = Path(__file__).resolve().parent.parent
REVERSE = "producers.tasks:score_reverse"
FNS = "tests.reward_fns"


def reverse_task(target: str, **extra: Any) -> dict[str, Any]:
    """The task fields of a `reverse` prompt whose answer is `target`."""
    return {"name": "reverse", "target": target, **extra}


# --- the pool ---------------------------------------------------------------------------


def score_then_recover(
    fn: str,
    task: dict[str, Any],
    limits: Limits = Limits(),
    isolation: Isolation = "auto",
    timeout: float = 0.5,
) -> tuple[Score, float, Score]:
    """Score with `fn` on a one-process pool (`timeout`), then a good call on the same pool.

    Returns the first score, how long it took, and the good call's score.
    """

    async def main() -> tuple[Score, float, Score]:
        async with RewardPool(
            processes=1, timeout=timeout, limits=limits, isolation=isolation
        ) as pool:
            await pool.resolve(fn)  # the import is not what is being timed
            start = time.monotonic()
            first = await pool.score(fn, "321", task)
            elapsed = time.monotonic() - start
            return first, elapsed, await pool.score(REVERSE, "321", reverse_task("321"))

    return asyncio.run(main())


@pytest.mark.parametrize(
    "name, reason",
    [
        ("hang", "timed out after 0.5s"),
        ("raise_error", "raised ValueError: no answer found"),
        ("sys_exit", "called sys.exit(3)"),
        ("segfault", "reward process killed by SIGSEGV"),
        ("null_pointer", "reward process killed by SIGSEGV"),
        ("allocate", "raised MemoryError"),
        ("nan", "returned a non-finite reward: nan"),
        ("infinite_component", "returned a non-finite length: inf"),
        ("string", "returned a str as reward, expected a number"),
        ("huge_file", "raised OSError: [Errno 27] File too large"),
    ],
)
def test_misbehaving_function_fails_with_reason_and_pool_recovers(
    name: str, reason: str, tmp_path: Path
) -> None:
    first, elapsed, after = score_then_recover(f"{FNS}:{name}", {"dir": str(tmp_path)})
    assert first == Score(0.0, {}, failed=True, reason=reason)
    assert elapsed < 3.0  # the deadline holds, and a crash is noticed at once
    assert after == Score(1.0)


def test_huge_file_is_cut_at_the_file_size_limit(tmp_path: Path) -> None:
    # Without isolation: a sandboxed process writes into its own /tmp, which the test cannot see.
    score_then_recover(
        f"{FNS}:huge_file", {"dir": str(tmp_path)}, Limits(file_bytes=1 << 20), "off"
    )
    assert (tmp_path / "huge.bin").stat().st_size == 1 << 20


def test_limits_apply_and_dict_return_gives_components() -> None:
    score, _, _ = score_then_recover(
        f"{FNS}:limits", {}, Limits(memory_bytes=1 << 30, file_bytes=1 << 20)
    )
    assert score == Score(1.0, {"memory": float(1 << 30), "file": float(1 << 20)})


def test_printing_does_not_corrupt_the_protocol() -> None:
    score, _, _ = score_then_recover(f"{FNS}:print_noise", {})
    assert score == Score(0.5)


def test_worker_credentials_are_not_in_the_reward_process_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key in ("NATS_URL", "JETRL_NATS_URL", "OTEL_SERVICE_NAME"):
        monkeypatch.setenv(key, "nats://user:secret@example:4222")
    assert reward_fns.sees_credentials("", {}) == 1.0  # the probe does see them in this process
    score, _, _ = score_then_recover(f"{FNS}:sees_credentials", {})
    assert score == Score(0.0)


def test_bad_specs_are_refused_with_one_line() -> None:
    cases = {
        "tests.reward_fns": "reward function 'tests.reward_fns' must be 'module:function'",
        "no_such_module:f": "reward function 'no_such_module:f': cannot import 'no_such_module': "
        "ModuleNotFoundError: No module named 'no_such_module'",
        f"{FNS}:missing": f"reward function '{FNS}:missing': module '{FNS}' has no attribute "
        "'missing'",
        f"{FNS}:NOT_CALLABLE": f"reward function '{FNS}:NOT_CALLABLE': "
        "'NOT_CALLABLE' is not callable (it is int)",
    }

    async def main() -> None:
        async with RewardPool(processes=1) as pool:
            for spec, message in cases.items():
                with pytest.raises(RewardSpecError) as resolved:
                    await pool.resolve(spec)
                with pytest.raises(RewardSpecError) as scored:  # remembered, not imported again
                    await pool.score(spec, "", {})
                assert str(resolved.value) == str(scored.value) == message

    asyncio.run(main())


@pytest.mark.parametrize("isolation", ["off", "auto"])
def test_reward_process_dies_with_its_worker(isolation: str) -> None:
    """A worker killed mid-call must not leave its reward process (or its sandbox) hanging on."""
    script = (
        "import asyncio, sys\n"
        "from consumers.reward_pool import RewardPool\n"
        "async def main():\n"
        f"    async with RewardPool(1, 3600, isolation={isolation!r}) as pool:\n"
        f"        await pool.score('{FNS}:hang', '', {{}})\n"
        "asyncio.run(main())\n"
    )
    worker = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT)
    wait_for(
        lambda: any(b"consumers.reward_child" in cmdline(pid) for pid in descendants(worker.pid))
    )
    started = descendants(worker.pid)
    time.sleep(0.5)  # into the call
    worker.kill()
    worker.wait()
    wait_for(lambda: not any(running(pid) for pid in started))


def cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def descendants(root: int) -> set[int]:
    """Every live process below `root` (from each /proc/<pid>/stat's parent field)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int(
                    (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]
                )
            except (OSError, IndexError, ValueError):
                continue
    found: set[int] = set()
    frontier = {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie waiting for a reaper is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


# --- the worker -------------------------------------------------------------------------


def run_config(topology: Topology, reward: str, batch: int = 16) -> RunConfig:
    """A run scored by `reward` in two processes with a 1 s deadline,
    `batch` items per round trip."""
    return RunConfig(
        run=topology.run,
        data=DataConfig(reward=reward),
        reward=RewardConfig(timeout=1.0, processes=2, batch=batch),
    )


Inputs = list[TrajectoryEvent | bytes]
"""Events, or raw bytes, to put on the trajectories subject."""


async def set_up_run(
    js: JetStreamContext, topology: Topology, config: RunConfig, inputs: Inputs
) -> None:
    """Declare the run, store its config, and put `inputs` (events or raw bytes) on the trajectories
    subject."""
    await topology.apply(js)
    await publish_config(await js.key_value(topology.kv_bucket), config)
    publisher = Publisher(js, topology)
    for item in inputs:
        if isinstance(item, bytes):
            await js.publish(topology.subject(TRAJECTORIES), item)
        else:
            await publisher.publish(TRAJECTORIES, item)


async def queue_empty(js: JetStreamContext, topology: Topology) -> bool:
    """Every trajectory handed out and settled (acked, or dead-lettered and terminated)."""
    lag = (await queue_lag(js, topology))[TRAJECTORIES.work_queue.durable]
    return lag is not None and lag.pending == 0 and lag.in_flight == 0


async def stored_rewards(js: JetStreamContext, topology: Topology) -> dict[str, RewardEvent]:
    """Every RewardEvent in the run's rewards stream, by id."""
    sub = await js.subscribe(topology.subject(REWARDS), ordered_consumer=True)
    count = await messages(js, topology, REWARDS)
    events = [decode((await sub.next_msg(timeout=5)).data, RewardEvent) for _ in range(count)]
    await sub.unsubscribe()
    return {event.id: event for event in events}


def run_reward_worker(
    server: EmbeddedNats, topology: Topology, config: RunConfig, inputs: Inputs
) -> tuple[dict[str, RewardEvent], list[tuple[bytes, str]], str]:
    """Run the reward stage in-process (its builder, as `python -m consumers.reward` does) over
    `inputs` until all are settled.

    Returns the stored rewards by id, the dead letters, and the worker's source id.
    """

    async def main() -> tuple[dict[str, RewardEvent], list[tuple[bytes, str]], str]:
        nc = await connect(server.url, "test")
        js = nc.jetstream()
        await set_up_run(js, topology, config, inputs)
        rt = await attach("reward", topology.run, server.url)
        stop = asyncio.Event()
        stage = await reward_stage.build(rt)
        try:
            task = asyncio.create_task(serve(rt, stage, stop))
            deadline = time.monotonic() + 20
            while not await queue_empty(js, topology):
                assert time.monotonic() < deadline and not task.done(), (
                    "worker did not settle every trajectory"
                )
                await asyncio.sleep(0.05)
            stop.set()
            await task
        finally:
            assert stage.close is not None  # the reward stage closes its pool
            await stage.close()
        try:
            return await stored_rewards(js, topology), await dead_letters(js, topology), rt.source
        finally:
            await rt.close()
            await nc.close()

    return asyncio.run(main())


def test_worker_publishes_rewards_and_dead_letters_garbage(
    nats_server: EmbeddedNats, topology: Topology
) -> None:
    cases = [  # response, finish reason, expected reward for target "321"
        ("321", "stop", 1.0),
        ("32", "length", 2 / 3),
        ("", "error", 0.0),  # scored like any other: empty text is the function's business
    ]
    trajectories = [
        trajectory(topology.run, prompt=i).model_copy(
            update={"response_text": text, "finish_reason": finish, "task": reverse_task("321")}
        )
        for i, (text, finish, _) in enumerate(cases)
    ]
    garbage = b"\x00\xffnot an event"
    rewards, dead, source = run_reward_worker(
        nats_server, topology, run_config(topology, REVERSE), [garbage, *trajectories]
    )
    assert rewards == {
        t.id: RewardEvent(
            id=t.id,
            run=topology.run,
            time=rewards[t.id].time,
            source=source,
            trajectory=t,
            reward=expected,
        )
        for t, (_, _, expected) in zip(trajectories, cases, strict=True)
    }
    assert len(dead) == 1 and dead[0][0] == garbage and dead[0][1].startswith("not msgpack")


@pytest.mark.parametrize("batch", [1, 16])
def test_hanging_reward_fails_one_sample_and_the_others_flow(
    batch: int, nats_server: EmbeddedNats, topology: Topology
) -> None:
    stuck = trajectory(topology.run, prompt=0).model_copy(
        update={"task": reverse_task("321", misbehave="hang")}
    )
    others = [
        trajectory(topology.run, prompt=i).model_copy(
            update={"response_text": "321", "task": reverse_task("321")}
        )
        for i in range(1, 6)
    ]
    rewards, dead, _ = run_reward_worker(
        nats_server,
        topology,
        run_config(topology, f"{FNS}:reverse_or_misbehave", batch),
        [stuck, *others],
    )
    failed = rewards.pop(stuck.id)
    assert (failed.failed, failed.reason, failed.reward) == (True, "timed out after 1s", 0.0)
    assert {i: (r.reward, r.failed) for i, r in rewards.items()} == {
        t.id: (1.0, False) for t in others
    }
    # Scored while the stuck call was still waiting for its deadline, not after it: all of them
    # one per trip; batched, those that shared the stuck one's trip wait for its deadline, the
    # rest (at least the other process's share) do not.
    early = [r for r in rewards.values() if r.time < failed.time]
    assert (len(early) == len(others)) if batch == 1 else (len(early) >= len(others) // 2)
    assert dead == []


def test_cli_refuses_a_bad_reward_function_and_drains_on_sigterm(
    nats_server: EmbeddedNats, topology: Topology
) -> None:
    async def setup(config: RunConfig, inputs: Inputs) -> None:
        nc = await connect(nats_server.url, "test")
        await set_up_run(nc.jetstream(), topology, config, inputs)
        await nc.close()

    def cli(stderr: int | None = None) -> subprocess.Popen[str]:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "consumers.reward",
                "--run",
                topology.run,
                "--nats",
                nats_server.url,
            ],
            cwd=ROOT,
            stderr=stderr,
            text=True,
        )

    asyncio.run(setup(run_config(topology, "no_such_module:score"), []))
    refused = cli(stderr=subprocess.PIPE)
    _, stderr = refused.communicate(timeout=30)
    assert refused.returncode == 1
    assert (
        stderr.strip()
        .splitlines()[-1]
        .startswith("consumers.reward: reward function 'no_such_module:score': cannot import")
    )

    good = trajectory(topology.run).model_copy(
        update={"response_text": "321", "task": reverse_task("321")}
    )
    asyncio.run(setup(run_config(topology, REVERSE), [good]))
    worker = cli()

    async def scored() -> bool:
        nc = await connect(nats_server.url, "test")
        try:
            return await messages(nc.jetstream(), topology, REWARDS) == 1
        finally:
            await nc.close()

    wait_for(lambda: asyncio.run(scored()), timeout=30)
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=15) == 0
