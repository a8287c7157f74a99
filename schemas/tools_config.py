"""`tools`: how an agent's tool calls run (`consumers.tool_runner`): in a sandboxed process per
episode, each call under a time limit, what it returns and prints under caps."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from schemas.section import Section

MIB = 1 << 20


class ToolsConfig(Section):
    timeout: float = Field(30.0, gt=0)
    """Seconds one tool call may take (wall clock; CPU time is bounded at 3x this). Past it the
    episode's tool process is killed and the call fails with `tool NAME: timed out after Ns`:
    the episode fails, the worker goes on, and the next episode gets a fresh process."""
    import_timeout: float = Field(60.0, gt=0)
    """Seconds importing a tool's module may take, on its first call in an episode's process
    (not counted in `timeout`)."""
    max_result_bytes: int = Field(64 * 1024, ge=1)
    """Most bytes (UTF-8) one call's result may have. A bigger result FAILS the call
    (`returned N bytes, over the M-byte cap`), it is not truncated: a cut result would be read
    by the model as the whole, and one this size would not fit a context anyway."""
    max_printed_bytes: int = Field(1 << 20, ge=0)
    """Most bytes a call may print (stdout and stderr together). Printed output never reaches
    the model or the worker's log (it is dropped); more than this fails the call
    (`printed N bytes, over the M-byte cap`)."""
    isolation: Literal["auto", "required", "off"] = "auto"
    """Namespaces around tool processes, as `reward.isolation` (no network, no bus, no other
    process's /proc, a private /tmp, the rest read-only; consumers/reward_sandbox.py): `auto`
    uses them where `unshare` works and warns once where not, `required` refuses to start
    without them, `off` never tries."""
    memory_mib: int = Field(2048, ge=64)
    """Address space of a tool process (RLIMIT_AS): past it allocations raise MemoryError."""
    workdir_mib: int = Field(64, ge=1)
    """Size of an episode's working directory (the sandbox's private /tmp, a tmpfs), and the
    largest file a tool may write (RLIMIT_FSIZE)."""
    max_processes: int = Field(64, ge=2)
    """Processes a sandboxed tool process may have at once, itself included (RLIMIT_NPROC in
    its own user namespace)."""

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib * MIB

    @property
    def workdir_bytes(self) -> int:
        return self.workdir_mib * MIB
