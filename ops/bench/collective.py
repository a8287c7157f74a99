"""`python -m ops.bench.collective [--quick]`: gloo weight broadcast vs plain TCP, same bytes,
same fan-out.

One source (this process) and two receiver processes on loopback. For each version size
(64 and 256 MB; 8 and 32 MB with --quick) and 1 or 2 receivers:
- ours: `CollectiveSource.publish` of a bf16 state dict to `CollectiveReceiver.receive(into=...)`,
  timed from the publish call until the last receiver has the version in its model (check-in,
  bucketed gloo broadcast, copy into the model); the first publish of a group also pays the
  rendezvous and is reported apart (`first_s`), the figure is the median of the next ones;
- baseline: the same number of bytes sent over plain TCP sockets, one per receiver, all at
  once, into a preallocated buffer: what loopback itself moves with the same fan-out.
MB/s counts the version's bytes once per version (not once per receiver). ratio = ours /
baseline at the largest size with 2 receivers. Every process runs one torch thread (see `run`).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import socket
import statistics
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from engines.collective import CollectiveReceiver, CollectiveSettings, CollectiveSource, Received

MB = 1 << 20


def state(mb: int) -> dict[str, torch.Tensor]:
    """A bf16 state dict of `mb` MiB in 32 tensors (a stand-in for a model's layers)."""
    n = mb * MB // 2 // 32
    return {f"layers.{i}.weight": torch.empty(n, dtype=torch.bfloat16).normal_() for i in range(32)}


def receiver(member: str, settings: CollectiveSettings, conn: Connection) -> None:
    torch.set_num_threads(1)  # see run()
    rcv = CollectiveReceiver(member, settings)
    models: dict[int, dict[str, torch.Tensor]] = {}
    while (cmd := conn.recv())[0] != "stop":
        kind, mb = cmd[0], cmd[1]
        if kind == "collective":
            _, _, address, version = cmd
            if mb not in models:  # the model a worker serves, allocated once
                models[mb] = {k: torch.zeros_like(v) for k, v in state(mb).items()}
            into = models[mb]
            got = rcv.receive(address, version, into=into)
            conn.send((isinstance(got, Received), time.monotonic(), getattr(got, "reason", "")))
        else:  # plain TCP into a preallocated buffer
            buf = bytearray(mb * MB)
            view = memoryview(buf)
            with socket.create_connection(("127.0.0.1", cmd[2])) as sock:
                got_bytes = 0
                while got_bytes < len(buf):
                    got_bytes += sock.recv_into(view[got_bytes:], len(buf) - got_bytes)
            conn.send((True, time.monotonic(), ""))


def tcp(conns: list[Connection], mb: int) -> float:
    """Seconds to move `mb` MiB to every receiver over its own socket, sent concurrently."""
    payload = memoryview(bytearray(mb * MB))
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.listen(len(conns))
        for c in conns:
            c.send(("tcp", mb, server.getsockname()[1]))
        peers = [server.accept()[0] for _ in conns]
        start = time.monotonic()
        threads = [threading.Thread(target=p.sendall, args=(payload,)) for p in peers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        done = max(c.recv()[1] for c in conns)
        for p in peers:
            p.close()
    return done - start


def run(quick: bool, repeats: int, bucket_mb: int) -> dict:
    # One intra-op thread per process: three processes with torch's default threads on two cores
    # made gloo's own threads wait for the copy threads, and the figures swung tenfold run to run.
    torch.set_num_threads(1)
    settings = CollectiveSettings(
        bucket_bytes=bucket_mb * MB, op_timeout_s=60.0, join_timeout_s=30.0
    )
    ctx = mp.get_context("spawn")
    members = ["r0", "r1"]
    pipes = [ctx.Pipe() for _ in members]
    procs = [
        ctx.Process(target=receiver, args=(m, settings, child), daemon=True)
        for m, (_, child) in zip(members, pipes, strict=True)
    ]
    for p in procs:
        p.start()
    conns = [parent for parent, _ in pipes]
    alive: list[str] = []
    source = CollectiveSource(lambda: alive, settings)
    version, figures = 0, {}
    try:
        for mb in (8, 32) if quick else (64, 256):
            tensors = state(mb)
            for count in (1, 2):
                alive[:] = members[:count]
                times = []
                for _ in range(repeats + 1):  # the first pays the group's rendezvous
                    version += 1
                    for c in conns[:count]:
                        c.send(("collective", mb, source.address, version))
                    start = time.monotonic()
                    published = source.publish(version, tensors)
                    answers = [c.recv() for c in conns[:count]]
                    if not all(ok for ok, _, _ in answers) or len(published.members) != count:
                        raise RuntimeError(
                            f"version {version} not delivered: {published} {answers}"
                        )
                    times.append(max(t for _, t, _ in answers) - start)
                base = statistics.median(tcp(conns[:count], mb) for _ in range(repeats))
                ours = statistics.median(times[1:])
                figures[f"{mb}MB_x{count}"] = {
                    "mb": mb,
                    "receivers": count,
                    "first_s": round(times[0], 3),
                    "seconds": round(ours, 3),
                    "mb_per_s": round(mb / ours, 1),
                    "tcp_mb_per_s": round(mb / base, 1),
                    "ratio": round(base / ours, 3),
                }
    finally:
        source.close()
        for c in conns:
            c.send(("stop", 0))
        for p in procs:
            p.join(10)
    top = figures[f"{32 if quick else 256}MB_x2"]
    return {
        "quick": quick,
        "bucket_mb": bucket_mb,
        "repeats": repeats,
        "sizes": figures,
        "mb_per_s": top["mb_per_s"],
        "baseline_mb_per_s": top["tcp_mb_per_s"],
        "ratio": top["ratio"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 and 32 MB instead of 64 and 256 MB")
    parser.add_argument(
        "--repeats", type=int, default=3, help="timed versions per configuration (median)"
    )
    parser.add_argument("--bucket-mb", type=int, default=64, help="bytes per broadcast, MiB")
    parser.add_argument(
        "--out", type=Path, default=None, help="also write the JSON here (a directory)"
    )
    args = parser.parse_args()
    figures = run(args.quick, args.repeats, args.bucket_mb)
    for name, row in figures["sizes"].items():
        print(
            f"{name:>10}: gloo {row['mb_per_s']:8.1f} MB/s (first {row['first_s']} s)   tcp "
            f"{row['tcp_mb_per_s']:8.1f} MB/s"
        )
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "collective.json").write_text(json.dumps(figures, indent=1))
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
