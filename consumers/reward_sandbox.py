"""Namespaces around reward processes: what a reward executes cannot reach the bus or the worker.

A reward process is started, where the machine allows it, through `unshare` (util-linux) in
new user, network, pid and mount namespaces:
- network: only a loopback interface that is down, so no connection to the run's NATS port
  (or anywhere);
- pid: a fresh `/proc` that shows only the sandbox's own processes, so no `/proc/<worker>/cmdline`
  or `environ`;
- mount: a private tmpfs on /tmp and /dev/shm (its working directory), an empty one over the
  directory of the worker's identity file (bus.identity; /dev/null over each seed there if
  the directory holds code to import), every other mount re-mounted read-only;
- user: root inside, mapped to the worker's own uid outside, which is what lets an
  unprivileged worker make the others; RLIMIT_NPROC then counts the sandbox's processes
  only (Linux >= 5.14 counts per user namespace), so a fork bomb stops at `Limits.processes`
  (and, on Linux >= 6.14, at the pid namespace's own pid_max, which binds root too).

Why `unshare` and not bubblewrap: it is part of util-linux, present wherever Linux is, and
does the same with these flags; bubblewrap is often absent (and not on PyPI).

The namespaces' init (pid 1) is a `/bin/sh` that waits for the python: pid 1 ignores signals
it has no handler for, so a python as pid 1 could not be killed by its own `os.kill`, and the
pool reports a death by signal through sh's exit status 128 + n.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import os
import shutil
import sys
from contextlib import suppress
from typing import Literal

log = logging.getLogger("jetrl.reward")

Isolation = Literal["auto", "required", "off"]
UNSHARE_FLAGS = (
    "--user",
    "--map-root-user",
    "--net",
    "--pid",
    "--fork",
    "--kill-child",
    "--mount",
    "--mount-proc",
)
DESCRIPTION = "unshare (user, network, pid and mount namespaces; private /tmp, the rest read-only)"
SIGNAL_EXIT = 128
"""sh exits with 128 + n when its child was killed by signal n."""

# mount(2) flags, from <sys/mount.h>; a read-only remount must keep the flags the mount has
# (a user namespace may not clear nosuid, nodev, noexec or the atime flags of a mount it inherited).
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND = (
    1,
    2,
    4,
    8,
    32,
    1024,
    2048,
    4096,
)
MS_RELATIME, MS_REC = 1 << 21, 16384
MOUNT_OPTIONS = {
    "nosuid": MS_NOSUID,
    "nodev": MS_NODEV,
    "noexec": MS_NOEXEC,
    "noatime": MS_NOATIME,
    "nodiratime": MS_NODIRATIME,
    "relatime": MS_RELATIME,
}
PID_MAX_MIN = 301
"""The least pid_max the kernel accepts."""
PRIVATE_DIRS = ("/tmp", "/dev/shm")
"""Writable, empty and the sandbox's own: a tmpfs each."""

_warned = False


class IsolationUnavailable(RuntimeError):
    """`reward.isolation: required` on a machine where the namespaces cannot be made; one line."""


PROBE = (
    "import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
    "from consumers.reward_sandbox import enter; enter(1 << 20, 64, [])"
)
"""A sandbox made as a reward process makes it: namespaces, mounts and limits, or an error."""


async def _unshare_works() -> str:
    """'' if a sandbox can be made here (`PROBE` in `command`), else why not (one line)."""
    paths = json.dumps([os.path.abspath(entry) for entry in sys.path if isinstance(entry, str)])
    try:
        proc = await asyncio.create_subprocess_exec(
            *command([sys.executable, "-c", PROBE, paths]),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        _, err = await asyncio.wait_for(proc.communicate(), 10)
    except (OSError, TimeoutError) as exc:
        return f"unshare failed: {exc}"
    return (
        "" if proc.returncode == 0 else " ".join(err.decode(errors="replace").split()[-30:])[:300]
    )


async def choose(isolation: Isolation) -> bool:
    """Whether reward processes run in the namespaces; says which in the log.

    `auto` falls back to plain processes with one warning per worker, `required` raises
    IsolationUnavailable, `off` never tries.
    """
    global _warned
    if isolation == "off":
        log.info(
            "reward isolation: off (reward processes share the worker's network, /proc and files)"
        )
        return False
    unshare = shutil.which("unshare") if sys.platform == "linux" else None
    why = "no unshare on PATH (util-linux)" if unshare is None else await _unshare_works()
    if not why:
        log.info("reward isolation: %s", DESCRIPTION)
        return True
    if isolation == "required":
        raise IsolationUnavailable(
            f"reward.isolation is 'required' but namespaces cannot be made here: {why}"
        )
    if not _warned:
        _warned = True
        log.warning(
            "reward isolation: none (%s); reward code can reach the network, "
            "other processes' /proc and the worker's files; "
            "set reward.isolation: required to refuse this",
            why,
        )
    return False


def command(argv: list[str]) -> list[str]:
    """`argv` run as the namespaces' python, under a sh that is their init."""
    unshare = shutil.which("unshare") or "unshare"
    return [unshare, *UNSHARE_FLAGS, "/bin/sh", "-c", '"$@"; exit $?', "sh", *argv]


# --- inside the sandbox (the reward process, before it serves) --------------------------


def enter(tmp_bytes: int, processes: int, hide: list[str]) -> None:
    """Private tmpfs dirs, the `hide` directories empty, everything else read-only, a process
    bound; raise OSError if a step fails."""
    import resource  # only the child needs it

    libc = ctypes.CDLL(None, use_errno=True)

    def mount(
        source: str, target: str, fstype: str | None, flags: int, data: str | None = None
    ) -> None:
        if (
            libc.mount(
                source.encode(),
                target.encode(),
                fstype.encode() if fstype else None,
                flags,
                data.encode() if data else None,
            )
            != 0
        ):
            errno = ctypes.get_errno()
            raise OSError(errno, f"mount {target}: {os.strerror(errno)}")

    # Counted per user namespace: the sandbox's processes (sh, this one, what it forks) only.
    # The kernel exempts uid 0 from it, so a worker running as root relies on the next bound.
    resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
    # Linux >= 6.14 keeps pid_max per pid namespace: no more than pid_max - 1 processes in it,
    # whoever the user (the kernel's least is 301). Older kernels refuse the write; then only
    # RLIMIT_NPROC bounds forks.
    with suppress(OSError), open("/proc/sys/kernel/pid_max", "w") as pid_max:
        pid_max.write(str(max(PID_MAX_MIN, processes + 1)))
    # /proc goes read-only below: pid_max is written first.
    # Import paths under a private dir (a checkout in /tmp) are held open and bound back in.
    kept = {
        path: os.open(path, os.O_PATH)
        for path in sys.path
        if path.startswith(tuple(d + "/" for d in PRIVATE_DIRS)) and os.path.isdir(path)
    }
    for path in PRIVATE_DIRS:
        if os.path.isdir(path):
            mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, f"size={tmp_bytes},mode=1777")
    for path, fd in kept.items():
        os.makedirs(path, exist_ok=True)
        mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        os.close(fd)
    for (
        path
    ) in hide:  # the worker's identity: an empty tmpfs over its directory, /dev/null over a file
        if not os.path.lexists(path):  # under a private dir: gone already
            continue
        if os.path.isdir(path):
            mount(
                "tmpfs",
                path,
                "tmpfs",
                MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
                "size=4k,mode=755",
            )
        else:
            mount("/dev/null", path, None, MS_BIND)
    for target, flags in _mounts():
        if target in PRIVATE_DIRS or flags & MS_RDONLY:
            continue
        try:
            mount("none", target, None, MS_REMOUNT | MS_BIND | MS_RDONLY | flags)
        except OSError:
            # /proc and /sys: the kernel refuses some of their submounts; their files are not
            # the worker's to write anyway (and /proc is the sandbox's own).
            if not target.startswith(("/proc", "/sys")):
                raise
    os.chdir("/tmp")
    for name in ("TMPDIR", "HOME"):
        os.environ[name] = "/tmp"


def _mounts() -> list[tuple[str, int]]:
    """(mount point, flags to keep) of every mount this process sees, parents first."""
    result = []
    with open("/proc/self/mountinfo") as info:
        for line in info:
            fields = line.split()
            target, options = fields[4].replace("\\040", " "), fields[5].split(",")
            flags = sum(MOUNT_OPTIONS.get(option, 0) for option in options)
            result.append((target, flags | (MS_RDONLY if "ro" in options else 0)))
    return result
