"""An embedded nats-server dies with the process that started it, even one SIGKILLed.

A test that runs out of time is SIGKILLed with its process group; the server is in a
session of its own (so Ctrl-C reaches the workers first), and without the death signal it
would be left running, holding its port and store, with nobody to stop it.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OWNER = (
    "import sys, time\n"
    "from pathlib import Path\n"
    "from bus.embedded import EmbeddedNats\n"
    "server = EmbeddedNats(Path(sys.argv[1])).start()\n"
    "print(server.process.pid, flush=True)\n"
    "time.sleep(600)\n"
)


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting to be reaped has died)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_server_dies_when_its_owner_is_sigkilled(tmp_path: Path) -> None:
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER, str(tmp_path)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    server = None
    try:
        assert owner.stdout is not None  # stdout=PIPE
        ready, _, _ = select.select([owner.stdout], [], [], 30)
        line = owner.stdout.readline() if ready else ""
        assert line.strip().isdigit(), f"the owner did not start a server within 30 s: {line!r}"
        server = int(line)
        assert alive(server), "the server was not running before its owner was killed"
        owner.kill()
        owner.wait()
        deadline = time.monotonic() + 10
        while alive(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(server), (
            f"nats-server {server} still running 10 s after its owner was SIGKILLed"
        )
    finally:
        if owner.poll() is None:
            owner.kill()
        owner.communicate()
        if server is not None and alive(server):
            os.kill(server, signal.SIGKILL)
