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
  the interpreter's import roots that the private dirs would hide (a checkout, a venv or an
  editable install's sources under /tmp: `import_roots`, `kept_paths`) are bound back in,
  read-only: the sandbox never hides the project or the user's environment;
- user: root inside, mapped to the worker's own uid outside, which is what lets an
  unprivileged worker make the others; once the mounts are made, every capability is
  dropped (`drop_capabilities`), so the code it runs cannot remount or unmount them;
  RLIMIT_NPROC then counts the sandbox's processes only (Linux >= 5.14 counts per user
  namespace), so a fork bomb stops at `Limits.processes`
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
from collections.abc import Iterable, Mapping, Sequence
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
PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS = 24, 38  # from <linux/prctl.h>
LINUX_CAPABILITY_VERSION_3 = 0x20080522  # from <linux/capability.h>
EINVAL = 22  # errno: prctl's answer for a capability past the kernel's last
PID_MAX_MIN = 301
"""The least pid_max the kernel accepts."""
PRIVATE_DIRS = ("/tmp", "/dev/shm")
"""Writable, empty and the sandbox's own: a tmpfs each."""

_warned: set[str] = set()
"""The sections warned of (once per worker each)."""


class IsolationUnavailable(RuntimeError):
    """`reward.isolation: required` on a machine where the namespaces cannot be made; one line."""


PROBE = (
    "import json, sys; sys.path[:] = json.loads(sys.argv[1]); "
    "from consumers.reward_sandbox import enter, import_roots, kept_paths; "
    "enter(1 << 20, 64, [], kept_paths(import_roots()))"
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


async def choose(isolation: Isolation, section: str = "reward") -> bool:
    """Whether `section`'s processes (reward, tools) run in the namespaces; says which in the log.

    `auto` falls back to plain processes with one warning per worker and section, `required`
    raises IsolationUnavailable, `off` never tries.
    """
    if isolation == "off":
        log.info(
            "%s isolation: off (%s processes share the worker's network, /proc and files)",
            section,
            section,
        )
        return False
    unshare = shutil.which("unshare") if sys.platform == "linux" else None
    why = "no unshare on PATH (util-linux)" if unshare is None else await _unshare_works()
    if not why:
        log.info("%s isolation: %s", section, DESCRIPTION)
        return True
    if isolation == "required":
        raise IsolationUnavailable(
            f"{section}.isolation is 'required' but namespaces cannot be made here: {why}"
        )
    if section not in _warned:
        _warned.add(section)
        log.warning(
            "%s isolation: none (%s); %s code can reach the network, "
            "other processes' /proc and the worker's files; "
            "set %s.isolation: required to refuse this",
            section,
            why,
            section,
            section,
        )
    return False


def command(argv: list[str]) -> list[str]:
    """`argv` run as the namespaces' python, under a sh that is their init."""
    unshare = shutil.which("unshare") or "unshare"
    return [unshare, *UNSHARE_FLAGS, "/bin/sh", "-c", '"$@"; exit $?', "sh", *argv]


# --- what the private dirs must not hide (decided in the worker) ------------------------


def kept_paths(roots: Iterable[str], private: Sequence[str] = PRIVATE_DIRS) -> list[str]:
    """Of the import roots `roots`, those a private dir would hide, to be bound back in.

    Only absolute paths strictly under one of `private` (a private dir itself is never kept:
    binding it back would undo it), normalized, without duplicates, and without those under
    another kept path (the outer bind shows them); sorted, so outer paths come first.
    """
    inside = tuple(directory.rstrip("/") + "/" for directory in private)
    under = sorted(
        {
            os.path.normpath(root)
            for root in roots
            if os.path.isabs(root) and os.path.normpath(root).startswith(inside)
        }
    )
    kept: list[str] = []
    for path in under:
        if not any(path.startswith(outer + "/") for outer in kept):
            kept.append(path)
    return kept


def import_roots(environ: Mapping[str, str] | None = None) -> list[str]:
    """Every directory this interpreter imports from, as given and as its real path.

    sys.path (with what .pth files added), sys.prefix and the base and exec prefixes (a venv:
    its site-packages and the interpreter it links to), PYTHONPATH, and the directories that
    editable-install finders on sys.meta_path map packages to (a setuptools editable install
    puts its sources on no sys.path entry). The reward module is found through these alone, so
    its directory is among them. Files (a single-module mapping) count as their directory;
    paths that do not exist are left out.
    """
    environ = os.environ if environ is None else environ
    candidates = [entry for entry in sys.path if isinstance(entry, str)]  # "": the cwd
    candidates += [sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix]
    candidates += [entry for entry in environ.get("PYTHONPATH", "").split(os.pathsep) if entry]
    for finder in sys.meta_path:
        candidates += _finder_paths(finder)
    roots: list[str] = []
    for candidate in candidates:
        path = os.path.abspath(candidate)
        if os.path.isfile(path):
            path = os.path.dirname(path)
        if os.path.isdir(path):
            roots += [path, os.path.realpath(path)]
    return list(dict.fromkeys(roots))


def _finder_paths(finder: object) -> list[str]:
    """The paths a meta path finder maps modules to: setuptools' editable finder keeps them in
    its module's MAPPING and NAMESPACES, others (editables) in a dict on the finder."""
    module_name = getattr(finder, "__module__", "") or ""
    if module_name.startswith(("_frozen_importlib", "importlib", "_distutils_hack")):
        return []
    module = sys.modules.get(module_name)
    tables = [getattr(module, name, None) for name in ("MAPPING", "NAMESPACES")]
    holder = finder if isinstance(finder, type) else type(finder)
    tables += [value for value in vars(holder).values() if isinstance(value, dict)]
    tables += [
        value for value in getattr(finder, "__dict__", {}).values() if isinstance(value, dict)
    ]
    paths: list[str] = []
    for table in tables:
        if not isinstance(table, dict):
            continue
        for value in table.values():
            values = value if isinstance(value, list | tuple) else [value]
            paths += [v for v in values if isinstance(v, str) and os.path.isabs(v)]
    return paths


# --- inside the sandbox (the reward process, before it serves) --------------------------


def enter(tmp_bytes: int, processes: int, hide: list[str], keep: list[str]) -> None:
    """Private tmpfs dirs with the `keep` paths (`kept_paths`) bound back in, the `hide`
    directories empty, everything else read-only, a process bound; raise OSError if a step
    fails."""
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
    # Import roots under a private dir (a checkout or a venv in /tmp) are held open and bound
    # back in (read-only with the rest, below).
    kept = {path: os.open(path, os.O_PATH) for path in keep if os.path.exists(path)}
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
    drop_capabilities(libc)


def drop_capabilities(libc: ctypes.CDLL) -> None:
    """Give up root in the user namespace, last: no capability left, none to regain by exec.

    The namespaces' root could otherwise undo the sandbox it was given: remount the
    read-only tree read-write (the read-only flag was set inside the namespace, so it is not
    locked), unmount the tmpfs over the identity, or mount anything. Emptying the bounding
    set and setting no_new_privs keeps an exec'ed program (root's, or a setuid one) from
    getting them back; the process stays uid 0 here, with only that uid's file permissions.
    """

    def check(result: int, what: str) -> None:
        if result != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"{what}: {os.strerror(errno)}")

    check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "no_new_privs")
    for cap in range(64):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            if ctypes.get_errno() == EINVAL:  # past the last capability this kernel has
                break
            check(-1, f"dropping capability {cap} from the bounding set")
    header = (ctypes.c_uint32 * 2)(LINUX_CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable; twice (64 bits)
    check(libc.capset(header, data), "capset")


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
