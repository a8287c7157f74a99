"""Tools run where they cannot hurt the run (issue 27): real tool processes, no mocks.

Each misbehaving tool (hang, raise, os._exit, segfault, a 10 MB result, 10 MB printed) ends
its call with a one-line reason naming the tool, this test process (the worker) goes on, and
a good call still succeeds from the same runner. An episode's files are its own: a later call
of the episode reads them, the next episode and the reward's sandbox do not.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import signal
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from consumers import reward_sandbox
from consumers.reward_pool import RewardPool, Score
from consumers.tool_runner import ToolOutcome, ToolRunner
from schemas.config import RunConfig
from schemas.tools_config import ToolsConfig

FNS = "tests.tool_runner_fns"
NAMES = ["add", "hang", "boom", "die", "segfault", "big_result", "big_print", "chatty"]
NAMES += ["write_file", "read_file", "remount_and_write", "connect", "signal_pid"]
SPECS = [f"{FNS}:{name}" for name in NAMES]
SHORT = ToolsConfig(timeout=1.0)
ISOLATED = asyncio.run(reward_sandbox.choose("auto", "tools"))
needs_namespaces = pytest.mark.skipif(
    not ISOLATED, reason="user/net/pid/mount namespaces cannot be made here"
)


def run(body: Callable[[ToolRunner], Awaitable[Any]], config: ToolsConfig = SHORT) -> Any:
    async def main() -> Any:
        async with ToolRunner(SPECS, config) as runner:
            return await body(runner)

    return asyncio.run(main())


def fail_then_recover(name: str, arguments: dict[str, Any]) -> tuple[ToolOutcome, ...]:
    """`name` called in one episode, then a good call in that episode and in the next one."""

    async def body(runner: ToolRunner) -> tuple[ToolOutcome, ...]:
        async with runner.episode() as tools:
            bad = await tools.call(name, arguments)
            same = await tools.call("add", {"a": 1, "b": 2})
        async with runner.episode() as tools:
            good = await tools.call("add", {"a": 2, "b": 3})
        return bad, same, good

    outcomes: tuple[ToolOutcome, ...] = run(body)
    return outcomes


def test_a_good_call_returns_its_result() -> None:
    async def body(runner: ToolRunner) -> list[ToolOutcome]:
        async with runner.episode() as tools:
            return [await tools.call("add", {"a": 17, "b": 25}), await tools.call("chatty", {})]

    added, chatty = run(body)
    assert (added.ok, added.content, added.reason) == (True, "42", "")
    assert chatty.message == "fine"  # printing a little is dropped, not an error


def test_a_hanging_tool_times_out_and_ends_its_process() -> None:
    bad, same, good = fail_then_recover("hang", {"seconds": 60})
    assert bad.reason == "tool hang: timed out after 1s"
    assert bad.fatal and same.fatal  # a hang ends the episode (consumers.episodes)
    assert 1.0 <= bad.seconds < 10.0
    assert same.reason == ("tool add: the episode's tool process was lost (timed out after 1s)")
    assert good == ToolOutcome(True, "5", "", good.seconds)


def test_the_default_time_limit_is_the_configs() -> None:
    """What a user gets: a runner made from the run config's defaults waits `tools.timeout`
    (30 s, docs/config.md) for a call, not the short limit the other tests use."""
    config = RunConfig().tools
    assert config.timeout == 30.0
    runner = ToolRunner(SPECS, config)
    assert runner.config.timeout == 30.0

    async def body(runner: ToolRunner) -> ToolOutcome:
        async with runner.episode() as tools:
            return await tools.call("hang", {"seconds": 2})

    slow = run(body, config)  # 2 s is within the default: the call succeeds
    assert (slow.ok, slow.content) == (True, "woke")


def test_a_raising_tool_fails_its_call_and_the_process_serves_on() -> None:
    bad, same, good = fail_then_recover("boom", {"message": "no such file"})
    assert bad.reason == "tool boom: raised RuntimeError: no such file"
    assert bad.message == "error: tool boom: raised RuntimeError: no such file"
    assert not bad.fatal  # the model reads the error and may call again
    assert same == ToolOutcome(True, "3", "", same.seconds)
    assert good.content == "5"


def test_a_tool_that_exits_its_process_fails_with_the_exit_code() -> None:
    bad, same, good = fail_then_recover("die", {"code": 3})
    assert bad.reason == "tool die: tool process exited with code 3"
    assert not same.ok and "was lost (tool process exited with code 3)" in same.reason
    assert good.content == "5"


def test_a_segfaulting_tool_fails_with_the_signal() -> None:
    bad, _, good = fail_then_recover("segfault", {})
    assert bad.reason == "tool segfault: tool process killed by SIGSEGV"
    assert bad.fatal
    assert good.content == "5"


def test_a_10mb_result_fails_at_the_cap() -> None:
    bad, same, good = fail_then_recover("big_result", {})
    assert bad.reason == f"tool big_result: returned {10 << 20} bytes, over the 65536-byte cap"
    assert bad.fatal and not same.fatal
    assert same.content == "3"  # over the cap is the call's failure: the process goes on
    assert good.content == "5"


def test_10mb_printed_fails_at_the_cap_and_never_reaches_the_worker(
    capfd: pytest.CaptureFixture[str],
) -> None:
    bad, same, good = fail_then_recover("big_print", {})
    assert bad.reason == f"tool big_print: printed {10 << 20} bytes, over the 1048576-byte cap"
    assert bad.fatal
    assert same.content == "3" and good.content == "5"
    out, err = capfd.readouterr()
    assert "yyyy" not in out + err


def test_an_unknown_tool_is_a_reason() -> None:
    async def body(runner: ToolRunner) -> ToolOutcome:
        async with runner.episode() as tools:
            return await tools.call("mul", {})

    unknown = run(body)
    assert unknown.reason.startswith("no tool named 'mul' (tools: add, big_print, big_result")
    assert not unknown.fatal  # the model's mistake: it reads the reason and goes on


async def _episode_files(runner: ToolRunner) -> tuple[list[ToolOutcome], str]:
    async with runner.episode() as tools:
        path = await tools.call("write_file", {"name": "secret.txt", "text": "42"})
        again = await tools.call("read_file", {"path": "secret.txt"})
    async with runner.episode() as tools:
        by_name = await tools.call("read_file", {"path": "secret.txt"})
        by_path = await tools.call("read_file", {"path": path.content})
    return [path, again, by_name, by_path], path.content


def _reward_sees(path: str) -> Score:
    async def score() -> Score:
        async with RewardPool(1, isolation="required") as pool:
            return await pool.score(
                f"{FNS}:sees_file", "done", {"path": path, "name": "secret.txt"}
            )

    return asyncio.run(score())


@needs_namespaces
def test_an_episodes_files_are_its_own_and_the_reward_gets_a_fresh_sandbox() -> None:
    """A file a tool wrote is read by the episode's next call; the next episode sees it
    neither by name nor by its absolute path, and the reward's sandbox does not either."""
    config = ToolsConfig(timeout=5.0, isolation="required")
    calls, path = run(lambda runner: _episode_files_alive(runner), config)
    wrote, again, by_name, by_path, reward_while_alive = calls
    assert wrote.ok and again.content == "42"
    assert (by_name.content, by_path.content) == ("missing", "missing")
    assert reward_while_alive == Score(0.0)
    assert _reward_sees(path) == Score(0.0)
    assert path == "/tmp/work/secret.txt"  # the sandbox's private tmpfs


async def _episode_files_alive(runner: ToolRunner) -> tuple[list[Any], str]:
    """`_episode_files`, and the reward asked while the writing episode still lives."""
    async with runner.episode() as writer:
        path = await writer.call("write_file", {"name": "secret.txt", "text": "42"})
        again = await writer.call("read_file", {"path": "secret.txt"})
        async with runner.episode() as other:
            by_name = await other.call("read_file", {"path": "secret.txt"})
            by_path = await other.call("read_file", {"path": path.content})
        async with RewardPool(1, isolation="required") as pool:
            seen = await pool.score(
                f"{FNS}:sees_file", "done", {"path": path.content, "name": "secret.txt"}
            )
    return [path, again, by_name, by_path, seen], path.content


def test_without_namespaces_each_episode_gets_a_fresh_directory_removed_at_its_end() -> None:
    """isolation off: the weaker claim that holds anyway. The next episode does not see the
    file by name, and the directory is gone when the episode ends."""
    config = ToolsConfig(timeout=5.0, isolation="off")
    (wrote, again, by_name, _), path = run(_episode_files, config)
    assert wrote.ok and os.path.basename(os.path.dirname(path)).startswith("jetrl-tool-")
    assert again.content == "42" and by_name.content == "missing"
    assert not os.path.exists(os.path.dirname(path))


@needs_namespaces
def test_sandboxed_code_cannot_remount_the_tree_read_write() -> None:
    """Root in its user namespace, a tool (or a reward) could remount the read-only tree
    read-write and write the project's files; its capabilities are dropped, so it cannot."""
    target = Path(__file__).resolve().parent.parent / f"escape-{secrets.token_hex(4)}"
    config = ToolsConfig(timeout=5.0, isolation="required")

    async def body(runner: ToolRunner) -> ToolOutcome:
        async with runner.episode() as tools:
            return await tools.call("remount_and_write", {"path": str(target)})

    async def reward() -> Score:
        async with RewardPool(1, isolation="required") as pool:
            return await pool.score(f"{FNS}:reward_remounts", "done", {"path": str(target)})

    try:
        tool = run(body, config)
        scored = asyncio.run(reward())
        assert not target.exists()
    finally:
        target.unlink(missing_ok=True)
    refused = "raised PermissionError: [Errno 1] remount /: Operation not permitted"
    assert tool.reason == f"tool remount_and_write: {refused}"
    assert scored == Score.failure(refused)


@needs_namespaces
def test_a_tool_cannot_reach_the_network_or_signal_the_worker() -> None:
    """A port listening on the host's loopback (as the run's NATS server does) is unreachable,
    and the worker's pid does not exist in the tool's pid namespace."""
    received: list[int] = []
    previous = signal.signal(signal.SIGUSR1, lambda signum, _frame: received.append(signum))
    config = ToolsConfig(timeout=5.0, isolation="required")

    async def body(runner: ToolRunner) -> list[ToolOutcome]:
        async with runner.episode() as tools:
            return [
                await tools.call("connect", {"port": port}),
                await tools.call("signal_pid", {"pid": os.getpid()}),
            ]

    try:
        with socket.create_server(("127.0.0.1", 0)) as server:
            port = server.getsockname()[1]
            connected, signalled = run(body, config)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert received == []
    assert connected.reason == "tool connect: raised OSError: [Errno 101] Network is unreachable"
    assert (
        signalled.reason == "tool signal_pid: raised ProcessLookupError: [Errno 3] No such process"
    )


def test_an_episode_needs_the_runner_entered() -> None:
    """The sandbox is chosen on entering the runner: an episode before that would have none."""
    with pytest.raises(RuntimeError, match="enter the ToolRunner first"):
        ToolRunner(SPECS).episode()
