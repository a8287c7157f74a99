"""The reward sandbox: reward code that tries to escape fails, its sample says why,
the pool goes on.

These need the namespaces (`unshare` able to make user, network, pid and mount namespaces); where
they cannot be made they are skipped, and `test_required_refuses_without_namespaces` still runs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bus.embedded import EmbeddedNats
from bus.identity import IDENTITY_ENV, new_seed, write_private
from bus.topology import Topology
from consumers import reward_sandbox
from consumers.reward_pool import Limits, RewardPool, Score
from consumers.reward_sandbox import IsolationUnavailable
from schemas.config import RewardConfig
from tests.helpers import trajectory
from tests.test_reward import (
    FNS,
    ROOT,
    reverse_task,
    run_config,
    run_reward_worker,
    score_then_recover,
)

ISOLATED = asyncio.run(reward_sandbox.choose("auto"))
FORK_DEADLINE = 20.0
"""Long enough for 300 forks (the least pid_max) on a loaded machine."""
needs_namespaces = pytest.mark.skipif(
    not ISOLATED, reason="user/net/pid/mount namespaces cannot be made here"
)


@needs_namespaces
def test_reward_code_cannot_connect_to_the_bus(nats_server: EmbeddedNats) -> None:
    score, _, after = score_then_recover(f"{FNS}:connect_bus", {"port": nats_server.port})
    assert score == Score.failure("raised OSError: [Errno 101] Network is unreachable")
    assert after == Score(1.0)


@needs_namespaces
def test_reward_code_cannot_read_the_workers_cmdline_or_environ() -> None:
    """The worker holds a secret on its command line and in its environment; the reward code
    looks for it in /proc of its parent and of the worker's pid (it is told the pid)."""
    secret = secrets.token_hex(8)
    script = (
        "import asyncio, json, os, sys\n"
        "from consumers.reward_pool import RewardPool\n"
        "async def main():\n"
        "    async with RewardPool(1, 5) as pool:\n"
        f"        task = {{'secret': sys.argv[1], 'pids': [os.getpid()]}}\n"
        f"        score = await pool.score('{FNS}:read_worker_proc', '', task)\n"
        "        print(json.dumps([score.reward, score.failed, score.reason]))\n"
        "asyncio.run(main())\n"
    )
    env = {**os.environ, "JETRL_NATS_PASSWORD": secret}
    out = subprocess.run(
        [sys.executable, "-c", script, secret],
        cwd=ROOT,
        env=env,
        capture_output=True,
        timeout=60,
        check=False,
    )
    assert json.loads(out.stdout.decode().splitlines()[-1]) == [0.0, False, ""]


@needs_namespaces
def test_reward_code_cannot_write_outside_its_directory() -> None:
    outside = ROOT / f".escape-{secrets.token_hex(4)}"
    try:
        score, _, after = score_then_recover(f"{FNS}:write_outside", {"path": str(outside)})
        assert score == Score.failure(
            f"raised OSError: [Errno 30] Read-only file system: '{outside}'"
        )
        assert not outside.exists()
        assert after == Score(1.0)
    finally:
        outside.unlink(missing_ok=True)


@needs_namespaces
def test_reward_code_cannot_read_the_workers_identity_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """The worker's seed file (outside /tmp, which is private anyway) is hidden from reward code."""
    directory = ROOT / f".identity-{secrets.token_hex(4)}"
    seed = directory / "reward.nk"
    try:
        directory.mkdir(mode=0o700)
        write_private(seed, new_seed())
        monkeypatch.setenv(IDENTITY_ENV, str(seed))
        score, _, after = score_then_recover(f"{FNS}:read_identity", {"path": str(seed)})
        assert score == Score.failure(
            f"raised FileNotFoundError: [Errno 2] No such file or directory: '{seed}'"
        )
        assert after == Score(1.0)
    finally:
        seed.unlink(missing_ok=True)
        directory.rmdir()


@needs_namespaces
def test_an_identity_under_tmp_is_out_of_sight_already(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The local job's identities may sit under /tmp, which the sandbox replaces:
    nothing to hide, no failure."""
    seed = tmp_path / "identities" / "reward.nk"
    seed.parent.mkdir(mode=0o700)
    write_private(seed, new_seed())
    monkeypatch.setenv(IDENTITY_ENV, str(seed))
    score, _, after = score_then_recover(f"{FNS}:read_identity", {"path": str(seed)})
    assert score == Score.failure(
        f"raised FileNotFoundError: [Errno 2] No such file or directory: '{seed}'"
    )
    assert after == Score(1.0)


@needs_namespaces
def test_a_seed_beside_the_code_is_hidden_and_the_code_still_imports(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An identity in a directory on the import path: its seeds read empty, its modules import."""
    directory = ROOT / f".identity-{secrets.token_hex(4)}"
    seed, module = directory / "reward.nk", f"beside_{secrets.token_hex(4)}"
    try:
        directory.mkdir(mode=0o700)
        write_private(seed, new_seed())
        (directory / f"{module}.py").write_text("from tests.reward_fns import read_identity\n")
        monkeypatch.setenv(IDENTITY_ENV, str(seed))
        monkeypatch.syspath_prepend(str(directory))
        score, _, _ = score_then_recover(f"{module}:read_identity", {"path": str(seed)})
        assert score == Score(0.0)
    finally:
        shutil.rmtree(directory)


@needs_namespaces
def test_reward_code_cannot_fork_without_bound() -> None:
    score, _, after = score_then_recover(
        f"{FNS}:fork_bomb", {"count": 400}, Limits(processes=32), timeout=FORK_DEADLINE
    )
    assert score == Score.failure(
        "raised BlockingIOError: [Errno 11] Resource temporarily unavailable"
    )
    assert after == Score(1.0)


@needs_namespaces
def test_escapes_fail_their_samples_and_the_run_goes_on(
    nats_server: EmbeddedNats, topology: Topology
) -> None:
    """The reward worker on a real bus: each escape is one failed sample,
    the good ones are scored."""
    outside = ROOT / f".escape-{secrets.token_hex(4)}"
    escapes: dict[str, dict[str, Any]] = {
        "connect_bus": {"port": nats_server.port},
        "write_outside": {"path": str(outside)},
        "fork_bomb": {"count": 400},
    }
    bad = [
        trajectory(topology.run, prompt=i).model_copy(
            update={"task": reverse_task("321", misbehave=name, **extra)}
        )
        for i, (name, extra) in enumerate(escapes.items())
    ]
    good = [
        trajectory(topology.run, prompt=10 + i).model_copy(
            update={"response_text": "321", "task": reverse_task("321")}
        )
        for i in range(3)
    ]
    config = run_config(topology, f"{FNS}:reverse_or_misbehave")
    config = config.model_copy(update={"reward": RewardConfig(timeout=FORK_DEADLINE, processes=2)})
    rewards, dead, _ = run_reward_worker(nats_server, topology, config, [*bad, *good])
    try:
        assert {t.id: (rewards[t.id].failed, rewards[t.id].reason.split(":")[0]) for t in bad} == {
            bad[0].id: (True, "raised OSError"),
            bad[1].id: (True, "raised OSError"),
            bad[2].id: (True, "raised BlockingIOError"),
        }
        assert {t.id: (rewards[t.id].reward, rewards[t.id].failed) for t in good} == {
            t.id: (1.0, False) for t in good
        }
        assert dead == [] and not outside.exists()
    finally:
        outside.unlink(missing_ok=True)


def test_required_refuses_without_namespaces(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """No `unshare` on PATH: `required` refuses in one line,
    `auto` warns once and scores as before."""
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(reward_sandbox, "_warned", set())
    with pytest.raises(IsolationUnavailable) as refused:
        asyncio.run(RewardPool(1, isolation="required").__aenter__())
    assert str(refused.value) == (
        "reward.isolation is 'required' but namespaces cannot be made here: no unshare on PATH "
        "(util-linux)"
    )
    assert "\n" not in str(refused.value)

    async def twice() -> list[Score]:
        scores = []
        for _ in range(2):
            async with RewardPool(1, 5, isolation="auto") as pool:
                assert not pool.sandboxed
                scores.append(
                    await pool.score("producers.tasks:score_reverse", "321", reverse_task("321"))
                )
        return scores

    with caplog.at_level(logging.INFO, logger="jetrl.reward"):
        assert asyncio.run(twice()) == [Score(1.0), Score(1.0)]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and warnings[0].startswith(
        "reward isolation: none (no unshare on PATH"
    )


@needs_namespaces
def test_a_reward_module_under_tmp_is_still_importable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sandbox's /tmp is its own, but an import path under the worker's /tmp is bound back in
    (read-only)."""
    module = f"tmp_reward_{secrets.token_hex(4)}"
    (tmp_path / f"{module}.py").write_text("def two(text, task):\n    return 2.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    score, _, _ = score_then_recover(f"{module}:two", {})
    assert score == Score(2.0)
