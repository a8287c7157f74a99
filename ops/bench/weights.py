"""`python -m ops.bench.weights [--quick] [--out DIR]`: weight versions through every transport vs
plain nats-py.

One embedded nats-server (8 MiB max payload), this process as the trainer, 4 rollout-worker
processes (spawned, one torch thread each), all on the same machine:
- model: a random-init Qwen2 (`engines.tiny`, the set-ups of `ops.bench.weight_delta`), about
  480 MiB in bf16 (60 MiB with --quick), after one real AdamW step at lr 1e-6 (float32 master
  weights published as bf16). Per transport (object_store, filesystem, collective over gloo):
  publish time (manifest sha256 included), then fetch-and-apply per worker with 1 worker and
  with 4 at once (fetch: the verified tensors; apply: copied into the worker's model), and the
  bytes moved. `delta_bytes_ratio`: the delta encoder's bytes for that step / the full bytes.
- sizes: transformer-shaped bf16 dicts of 64, 256 and 512 MiB (16 and 64 with --quick), each
  fetched by 1 worker through every transport: fetch time against size (`weights.png`).
- baseline, in the same run and the same worker processes: the same number of bytes read with
  plain nats-py from a JetStream stream of 8 MiB messages, in order, by an ordered consumer
  whose callback copies each into a preallocated buffer (iterating `sub.messages` is slower:
  nats-py answers flow control from that iterator only every 0.25 s).
Every figure is the median of `--repeats` versions, the object store's fetch and the baseline
interleaved; every worker first fetches and reads once, untimed. Collective receivers check the
manifest's sha256 like the other transports do; a new collective group's rendezvous is paid by a
tiny version, untimed. ratio = fetch_mb_per_s / baseline_mb_per_s: object store, 1 worker,
the model.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch
from nats.js.api import StorageType, StreamConfig

from bus.connection import JetStream, connect
from bus.embedded import MAX_PAYLOAD, EmbeddedNats
from consumers.weights.filesystem import FilesystemTransport
from consumers.weights.object_store import ObjectStoreTransport
from consumers.weights.sender import publish_version
from consumers.weights.transport import WeightTransport
from engines.collective import CollectiveReceiver, CollectiveSettings, CollectiveSource, Received
from engines.tiny import build_tiny_model
from engines.weight_delta import encode_shard
from engines.weights import manifest_of
from ops.bench.weight_delta import MODELS, adamw_step
from producers.tasks import VOCAB
from schemas.weight_event import WeightVersionEvent

MiB = 1 << 20
RUN, BUCKET, WORKERS = "bench", "rl_bench_weights", 4
TRANSPORTS = ("object_store", "filesystem", "collective")
Weights = dict[str, torch.Tensor]


def shaped(mb: int, hidden: int = 1024) -> Weights:
    """A bf16 dict of `mb` MiB (to a row) shaped like a decoder: layers of attention (4:1
    grouped kv) and MLP (4x) matrices plus norms, the embedding taking the rest."""
    kv, inter = hidden // 4, 4 * hidden
    layer = {
        "q_proj": (hidden, hidden),
        "k_proj": (kv, hidden),
        "v_proj": (kv, hidden),
        "o_proj": (hidden, hidden),
        "gate_proj": (inter, hidden),
        "up_proj": (inter, hidden),
        "down_proj": (hidden, inter),
        "norm": (hidden,),
    }
    per_layer = 2 * sum(torch.Size(s).numel() for s in layer.values())
    layers = max((mb * MiB - 8 * MiB) // per_layer, 0)
    out = {
        "model.embed_tokens.weight": torch.empty(
            (mb * MiB - layers * per_layer) // (2 * hidden), hidden
        )
    }
    out |= {
        f"model.layers.{i}.{n}.weight": torch.empty(s)
        for i in range(layers)
        for n, s in layer.items()
    }
    return {n: t.normal_(0, 0.02).to(torch.bfloat16) for n, t in out.items()}


def nbytes(tensors: Weights) -> int:
    return sum(t.nbytes for t in tensors.values())


# ---- a rollout worker (its own process) ---------------------------------------------------------


def worker(index: int, url: str, root: str, settings: CollectiveSettings, conn: Connection) -> None:
    torch.set_num_threads(1)  # 5 processes on 2 cores: see ops.bench.collective
    asyncio.run(serve(index, url, Path(root), settings, conn))


async def serve(
    index: int, url: str, root: Path, settings: CollectiveSettings, conn: Connection
) -> None:
    """Commands from the trainer, answered with (start, fetched, applied) monotonic times."""
    nc = await connect(url, f"bench-weights-w{index}")
    js = nc.jetstream()
    transports: dict[str, WeightTransport] = {
        "object_store": ObjectStoreTransport(js, BUCKET, keep=2),
        "filesystem": FilesystemTransport(root, keep=2),
    }
    receiver = CollectiveReceiver(f"w{index}", settings)
    loop, models = asyncio.get_running_loop(), {}
    while (cmd := await loop.run_in_executor(None, conn.recv))[0] != "stop":
        kind, manifest = cmd[0], cmd[1]
        key = tuple((s.name, s.shape) for s in manifest)
        if key not in models:  # the model the worker serves, allocated (and touched) once per shape
            models[key] = {
                s.name: torch.zeros(s.shape, dtype=getattr(torch, s.dtype)) for s in manifest
            }
        model = models[key]
        start = time.monotonic()
        if kind == "fetch":
            tensors = await transports[cmd[2].transport].fetch(cmd[2])
            fetched = time.monotonic()
            with torch.no_grad():
                for name, tensor in tensors.items():
                    model[name].copy_(tensor)
            del tensors
        elif kind == "collective":
            checksums = {s.name: s.sha256 for s in manifest}
            got = receiver.receive(cmd[2], cmd[3], into=model, checksums=checksums)
            if not isinstance(got, Received):
                raise RuntimeError(f"worker {index}: collective version {cmd[3]} missed: {got}")
            fetched = time.monotonic()
        else:  # baseline: plain nats-py, same bytes
            fetched = start + await baseline(js, cmd[2], cmd[3])
        conn.send((start, fetched, time.monotonic()))
    receiver.close()
    await nc.close()


async def baseline(js: JetStream, subject: str, size: int) -> float:
    """Seconds to read `size` bytes of 8 MiB messages on `subject` in order into one buffer."""
    view = memoryview(bytearray(size))
    done, offset = asyncio.get_running_loop().create_future(), 0

    async def arrived(msg: object) -> None:
        nonlocal offset
        data = msg.data  # type: ignore[attr-defined]
        view[offset : offset + len(data)] = data
        offset += len(data)
        if offset >= size and not done.done():
            done.set_result(None)

    start = time.perf_counter()
    # Plain nats-py's ordered consumer, not a `bus.readers` reader: the raw client call is what
    # this baseline measures the transports against.
    sub = await js.subscribe(subject, ordered_consumer=True, cb=arrived)
    await done
    seconds = time.perf_counter() - start
    await sub.unsubscribe()
    return seconds


# ---- the trainer (this process) -----------------------------------------------------------------


class Bench:
    def __init__(
        self, js: JetStream, root: Path, conns: list[Connection], settings: CollectiveSettings
    ) -> None:
        self.js, self.conns, self.version = js, conns, 0
        self.transports: dict[str, WeightTransport] = {
            "object_store": ObjectStoreTransport(js, BUCKET, keep=2),
            "filesystem": FilesystemTransport(root, keep=2),
        }
        self.alive: list[str] = []
        self.source = CollectiveSource(lambda: self.alive, settings)

    async def ask(self, cmds: list[tuple]) -> list[tuple[float, float, float]]:
        """Send worker i cmds[i] (all at once); their (start, fetched, applied) times."""
        for conn, cmd in zip(self.conns, cmds, strict=False):
            conn.send(cmd)
        return [await asyncio.to_thread(conn.recv) for conn in self.conns[: len(cmds)]]

    async def publish(
        self, name: str, tensors: Weights, workers: int
    ) -> tuple[float, list[tuple[float, float, float]], object]:
        """(publish seconds, the workers' times, the event or address) of one new version."""
        self.version += 1
        if name != "collective":
            start = time.monotonic()
            event = await publish_version(
                self.transports[name], RUN, "bench", self.version, tensors
            )
            return time.monotonic() - start, [], event
        manifest = await asyncio.to_thread(manifest_of, tensors)
        if self.alive != [
            f"w{i}" for i in range(workers)
        ]:  # a new group pays its rendezvous untimed
            self.alive[:] = [f"w{i}" for i in range(workers)]
            tiny = {"warm": torch.zeros(8)}
            warm = asyncio.ensure_future(
                self.ask(
                    [("collective", manifest_of(tiny), self.source.address, self.version)] * workers
                )
            )
            await asyncio.to_thread(self.source.publish, self.version, tiny)
            await warm
            self.version += 1
        pending: asyncio.Future[list[tuple[float, float, float]]] = asyncio.ensure_future(
            self.ask([("collective", manifest, self.source.address, self.version)] * workers)
        )
        start = time.monotonic()
        published = await asyncio.to_thread(self.source.publish, self.version, tensors)
        seconds = time.monotonic() - start
        if len(published.members) != workers:
            raise RuntimeError(f"collective version {self.version}: {published}")
        return seconds, await pending, self.source.address

    async def fetch(
        self, name: str, tensors: Weights, workers: int, repeats: int, baseline: bool = False
    ) -> dict:
        """Median publish and per-worker fetch / fetch-and-apply seconds over `repeats` versions;
        with `baseline`, the plain nats-py read of the same bytes right after each fetch."""
        runs, base, size = [], [], nbytes(tensors)
        subject = await self.base_stream(size) if baseline else ""
        for _ in range(repeats):
            seconds, times, event = await self.publish(name, tensors, workers)
            if name != "collective":
                assert isinstance(event, WeightVersionEvent)
                times = await self.ask([("fetch", event.manifest, event)] * workers)
            runs.append((seconds, times))
            if baseline:
                base.append(
                    statistics.mean(
                        f - s for s, f, _ in await self.ask([("base", (), subject, size)] * workers)
                    )
                )
        if baseline:
            await self.js.delete_stream(subject.replace(".", "_").upper())
        per = [[(f - s, a - s) for s, f, a in times] for _, times in runs]
        return {
            "mb": round(size / MiB, 1),
            "bytes": size,
            "workers": workers,
            "publish_s": round(statistics.median(s for s, _ in runs), 3),
            "fetch_s": round(statistics.median(statistics.mean(f for f, _ in w) for w in per), 3),
            "fetch_apply_s": round(
                statistics.median(statistics.mean(a for _, a in w) for w in per), 3
            ),
            "slowest_worker_s": round(statistics.median(max(a for _, a in w) for w in per), 3),
            # tensor bytes: stored once then read by each worker;
            # the collective's publish is its delivery
            "bytes_moved": size * workers if name == "collective" else size * (1 + workers),
        } | ({"baseline_s": round(statistics.median(base), 3)} if baseline else {})

    async def base_stream(self, size: int) -> str:
        """A stream holding `size` bytes in 8 MiB messages (the baseline reads it); its subject."""
        subject = f"bench.base.{size}"
        await self.js.add_stream(
            StreamConfig(
                name=subject.replace(".", "_").upper(),
                subjects=[subject],
                storage=StorageType.FILE,
                max_msg_size=MAX_PAYLOAD,
            )
        )
        chunk = os.urandom(MAX_PAYLOAD)
        for offset in range(0, size, MAX_PAYLOAD):
            await self.js.publish(subject, chunk[: min(MAX_PAYLOAD, size - offset)])
        return subject


def progress(text: str) -> None:
    print(text, flush=True)


async def bench(
    url: str,
    root: Path,
    quick: bool,
    repeats: int,
    conns: list[Connection],
    settings: CollectiveSettings,
    model: tuple[Weights, Weights],
) -> dict:
    nc = await connect(url, "bench-weights-trainer")
    js = nc.jetstream()
    await js.create_object_store(BUCKET)
    b = Bench(js, root, conns, settings)
    before, after = model
    size = nbytes(after)
    figures: dict = {
        "quick": quick,
        "repeats": repeats,
        "workers": WORKERS,
        "model_mb": round(size / MiB, 1),
        "tensors": len(after),
        "transports": {},
        "sweep": {},
    }
    try:
        payload, _ = encode_shard(before, after, list(after), version=1, base_version=0)
        figures["delta_bytes_ratio"] = round(len(payload) / size, 5)
        progress(
            f"model {size / MiB:.0f} MiB, {len(after)} tensors; delta after one AdamW step: "
            f"{figures['delta_bytes_ratio']:.4f} of the bytes"
        )
        # Untimed: every worker's first fetch and read (connections, consumers, first-touch pages).
        warm = shaped(16)
        await b.fetch("object_store", warm, WORKERS, 1, baseline=True)
        await b.fetch("filesystem", warm, WORKERS, 1)
        for name in TRANSPORTS:
            rows = {
                f"x{w}": await b.fetch(name, after, w, repeats, baseline=name == "object_store")
                for w in (1, WORKERS)
            }
            figures["transports"][name] = rows
            progress(
                f"{name:>12}: publish {rows['x1']['publish_s']:.2f} s, fetch+apply 1 worker "
                f"{rows['x1']['fetch_apply_s']:.2f} s, {WORKERS} workers "
                f"{rows[f'x{WORKERS}']['fetch_apply_s']:.2f} s each"
            )
        rows = figures["transports"]["object_store"]
        figures["baseline"] = {key: rows[key].pop("baseline_s") for key in rows}
        progress(
            f"    baseline: 1 worker {figures['baseline']['x1']:.2f} s, {WORKERS} workers "
            f"{figures['baseline'][f'x{WORKERS}']:.2f} s each (plain nats-py)"
        )
        for mb in (16, 64) if quick else (64, 256, 512):
            tensors, row = shaped(mb), dict[str, Any]()
            for name in TRANSPORTS:
                got = await b.fetch(name, tensors, 1, repeats, baseline=name == "object_store")
                row[name] = {key: got[key] for key in ("publish_s", "fetch_s", "fetch_apply_s")}
                row.setdefault("baseline_s", got.get("baseline_s"))
            figures["sweep"][str(mb)] = row
            progress(
                f"{mb:>4} MiB: baseline {row['baseline_s']:.2f} s, "
                + ", ".join(f"{n} {row[n]['fetch_s']:.2f} s" for n in TRANSPORTS)
            )
            del tensors
    finally:
        b.source.close()
        await nc.close()
    os_row = figures["transports"]["object_store"]["x1"]
    figures["fetch_mb_per_s"] = round(size / MiB / os_row["fetch_s"], 1)
    figures["baseline_mb_per_s"] = round(size / MiB / figures["baseline"]["x1"], 1)
    figures["sizes_mb"] = {
        mb: row["object_store"]["fetch_s"] for mb, row in figures["sweep"].items()
    }
    first, last = (
        int(k) for k in (min(figures["sizes_mb"], key=int), max(figures["sizes_mb"], key=int))
    )
    # seconds per MiB at the largest size / at the smallest: 1.0 is linear,
    # 8.0 at 8x the size quadratic
    figures["linearity"] = round(
        (figures["sizes_mb"][str(last)] / last) / (figures["sizes_mb"][str(first)] / first), 3
    )
    figures["ratio"] = round(figures["fetch_mb_per_s"] / figures["baseline_mb_per_s"], 3)
    return figures


def plot(figures: dict, out: Path) -> None:
    """weights.json and weights.png (fetch seconds against MiB, one line per transport) in `out`."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "weights.json").write_text(json.dumps(figures, indent=1) + "\n")
    sizes = sorted(figures["sweep"], key=int)
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in (*TRANSPORTS, "baseline"):
        seconds = [
            figures["sweep"][mb]["baseline_s"]
            if name == "baseline"
            else figures["sweep"][mb][name]["fetch_s"]
            for mb in sizes
        ]
        ax.plot(
            [int(mb) for mb in sizes],
            seconds,
            marker="o",
            linestyle="--" if name == "baseline" else "-",
            label="baseline: plain nats-py stream" if name == "baseline" else name,
        )
    ax.set_xlabel("weight version, MiB (bf16)")
    ax.set_ylabel("fetch seconds, 1 worker (verified)")
    ax.set_title("ops.bench.weights: fetch time against size")
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "weights.png", dpi=80)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick",
        action="store_true",
        help="a 60 MiB model and 16, 64 MiB sizes (instead of 480; 64, 256, 512)",
    )
    parser.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="versions per figure, median (default 3, 2 with --quick)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("runs/bench-weights"),
        help="where weights.json and weights.png go",
    )
    args = parser.parse_args()
    repeats = args.repeats or (2 if args.quick else 3)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    settings = CollectiveSettings(bucket_bytes=64 * MiB, op_timeout_s=120.0, join_timeout_s=60.0)
    with tempfile.TemporaryDirectory() as tmp:
        progress("building the model and taking one AdamW step")
        model_dir = build_tiny_model(
            Path(tmp) / "model", VOCAB, **MODELS["quick" if args.quick else "full"]
        )
        model = adamw_step(model_dir, torch.float32)
        with EmbeddedNats(Path(tmp) / "nats") as server:
            ctx = mp.get_context("spawn")
            pipes = [ctx.Pipe() for _ in range(WORKERS)]
            procs = [
                ctx.Process(
                    target=worker,
                    args=(i, server.url, str(Path(tmp) / "weights"), settings, child),
                    daemon=True,
                )
                for i, (_, child) in enumerate(pipes)
            ]
            for p in procs:
                p.start()
            conns = [parent for parent, _ in pipes]
            try:
                figures = asyncio.run(
                    bench(
                        server.url,
                        Path(tmp) / "weights",
                        args.quick,
                        repeats,
                        conns,
                        settings,
                        model,
                    )
                )
            finally:
                for conn in conns:
                    conn.send(("stop", ()))
                for p in procs:
                    p.join(10)
    plot(figures, args.out)
    progress(f"wrote {args.out / 'weights.json'} and {args.out / 'weights.png'}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
