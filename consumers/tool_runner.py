"""Run an agent's tool calls where they cannot hurt the run: one sandboxed process per episode.

    ToolRunner(["calc:add", ...], config.tools)       schemas here (engines.tools.load_tools)
      async with runner:                               isolation chosen once, logged
        async with runner.episode() as tools:          one episode: one private working dir
            outcome = await tools.call("add", {"a": 1, "b": 2})
              --first call--> a tool process (consumers/tool_child.py, started through the
                              reward sandbox's machinery, consumers/sandbox_process.py)
              --import the tool (import_timeout), call it (timeout)--> ToolOutcome

An episode's calls run one at a time in its own process, whose working directory is the
episode's: inside the sandbox, `/tmp/work` on the process's private tmpfs; without one, a
fresh `jetrl-tool-*` directory the runner makes and removes. So files a tool writes are seen
by the episode's later calls and by no other episode, and they are gone when the episode ends.
A reward function never sees them: it runs in the reward pool's own sandbox (a fresh private
/tmp), and judges what the trajectory and its task say, not the agent's files (a reward that
checks side effects re-creates them from the trajectory, as slime's SWE recipe does).

What a tool does ends its call, never the worker: a raise (`raised ValueError: ...`), a
result over `max_result_bytes` or printed output over `max_printed_bytes` fail the call and
the process serves on; a hang (`timed out after 30s`), a crash (`tool process killed by
SIGSEGV`, `tool process exited with code 3`) or a broken reply kill the process and fail the
call, and the episode's later calls fail with that reason (its working directory went with
the process); the next episode gets a fresh process. Every reason is one line and names the
tool. Deciding what a failed call means (the episode fails) is the episode runner's business.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from consumers import reward_sandbox
from consumers.sandbox_process import ChildLost, Limits, SandboxProcess, one_line
from engines.tools import Tool, load_tools
from schemas.tools_config import ToolsConfig

CHILD_MODULE = "consumers.tool_child"
REPLY_SLACK = 4096
"""Bytes a reply may have beyond `max_result_bytes` (framing, an error line)."""


@dataclass(frozen=True)
class ToolOutcome:
    """What one call gave: its result (`ok`), or why it failed (one line)."""

    ok: bool
    content: str
    """The result as the model reads it ('' when the call failed)."""
    reason: str
    """Why the call failed, naming the tool ('' when it did not)."""
    seconds: float
    """Wall time of the call, the process start and import included."""
    fatal: bool = False
    """The failure ends the episode (`consumers.episodes`): the tool hung, crashed, or went
    over a cap, or the episode's process is gone. False for what the model may read and act
    on: a tool that raised (bad arguments), a tool that does not exist."""

    @property
    def message(self) -> str:
        """The tool message's content: the result, or the failure for the model to read."""
        return self.content if self.ok else f"error: {self.reason}"


class ToolRunner:
    """The tools `specs` name, run in sandboxed processes under `config`'s limits. Use as
    `async with ToolRunner(...) as runner:` in the event loop that calls it."""

    def __init__(self, specs: Sequence[str], config: ToolsConfig | None = None) -> None:
        self.config = config or ToolsConfig()
        self.tools: dict[str, Tool] = load_tools(specs)
        """By name, with their schemas (for the prompt); a bad name raised ToolError."""
        self.limits = Limits(
            memory_bytes=self.config.memory_bytes,
            file_bytes=self.config.workdir_bytes,
            processes=self.config.max_processes,
            tmp_bytes=self.config.workdir_bytes,
        )
        self.sandboxed = False
        """Whether tool processes run in namespaces; decided (and logged) on entering."""
        self._episodes: set[ToolEpisode] = set()
        self._entered = False

    async def __aenter__(self) -> ToolRunner:
        self.sandboxed = await reward_sandbox.choose(self.config.isolation, "tools")
        self._entered = True
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await asyncio.gather(*(episode.close() for episode in list(self._episodes)))

    def episode(self) -> ToolEpisode:
        """The tools of one episode: its own process and working directory, made on its first
        call; `async with` it (or `close` it) when the episode ends."""
        if not self._entered:  # the isolation is chosen on entering: none would be no sandbox
            raise RuntimeError("enter the ToolRunner first (async with): it chooses the sandbox")
        episode = ToolEpisode(self)
        self._episodes.add(episode)
        return episode


class ToolEpisode:
    """One episode's tool calls, one at a time, in one process and working directory."""

    def __init__(self, runner: ToolRunner) -> None:
        self.runner = runner
        self._process: SandboxProcess | None = None
        self._host_dir: str | None = None
        self._lost = ""
        self._closed = False
        self._lock = asyncio.Lock()

    async def __aenter__(self) -> ToolEpisode:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()

    @property
    def workdir(self) -> str:
        """The working directory as the episode's tools see it ('' before the first call of
        an episode without namespaces: its directory is made with the process)."""
        return self._host_dir or ("/tmp/work" if self.runner.sandboxed else "")

    async def call(self, name: str, arguments: dict[str, Any]) -> ToolOutcome:
        """Call tool `name` with `arguments` in this episode's process; never raises for what
        the tool does."""
        start = time.monotonic()

        def failed(reason: str, fatal: bool = True) -> ToolOutcome:
            return ToolOutcome(False, "", one_line(reason), time.monotonic() - start, fatal)

        tool = self.runner.tools.get(name)
        if tool is None:
            known = ", ".join(sorted(self.runner.tools)) or "none"
            return failed(f"no tool named {name!r} (tools: {known})", fatal=False)
        async with self._lock:
            if self._closed:
                return failed(f"tool {name}: the episode's tools are closed")
            if self._lost:
                return failed(f"tool {name}: the episode's tool process was lost ({self._lost})")
            try:
                reply = await self._request(tool, arguments)
            except ChildLost as exc:
                self._lost = str(exc)
                await self._discard()
                return failed(f"tool {name}: {exc}")
            except BaseException:  # cancelled mid-call: the process was killed with it
                self._lost = "a call was cancelled"
                await self._discard()
                raise
        if "error" in reply:
            return failed(f"tool {name}: {reply['error']}", fatal=bool(reply.get("fatal")))
        content = reply.get("content")
        if not isinstance(content, str):
            return failed(f"tool {name}: malformed reply from the tool process")
        return ToolOutcome(True, content, "", time.monotonic() - start)

    async def _request(self, tool: Tool, arguments: dict[str, Any]) -> dict[str, Any]:
        config = self.runner.config
        process = self._process or await self._spawn()
        if tool.spec not in process.resolved:
            loaded = await process.request({"op": "load", "spec": tool.spec}, config.import_timeout)
            if "error" in loaded:
                return loaded
            process.resolved.add(tool.spec)
        request = {"op": "call", "spec": tool.spec, "arguments": arguments}
        return await process.request(request, config.timeout)

    async def _spawn(self) -> SandboxProcess:
        runner, config = self.runner, self.runner.config
        if not runner.sandboxed:
            self._host_dir = tempfile.mkdtemp(prefix="jetrl-tool-")
        self._process = await SandboxProcess.spawn(
            CHILD_MODULE,
            runner.limits,
            runner.sandboxed,
            what="tool process",
            max_reply_bytes=config.max_result_bytes + REPLY_SLACK,
            init={
                "workdir": self._host_dir,
                "max_result": config.max_result_bytes,
                "max_printed": config.max_printed_bytes,
            },
        )
        return self._process

    async def _discard(self) -> None:
        """Kill the process (if alive) and remove the working directory the runner made."""
        if self._process is not None:
            await self._process.kill()
            self._process = None
        if self._host_dir is not None:
            shutil.rmtree(self._host_dir, ignore_errors=True)
            self._host_dir = None

    async def close(self) -> None:
        """End the episode's tools: its process, anything it started, and its files."""
        self._closed = True
        await self._discard()
        self.runner._episodes.discard(self)
