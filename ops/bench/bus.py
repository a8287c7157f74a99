"""`python -m ops.bench.bus [--quick]`: our publisher -> worker loop -> ack vs raw nats-py.

For TrajectoryEvents of 1k, 4k and 16k response tokens, on one embedded server in one run:
- ours: `Publisher.send` (encode, Nats-Msg-Id, traceparent, bounded in-flight bytes) then a
  `Worker` (fetch, decode + validate, process span, ack) with a no-op handler;
- baseline: raw `js.publish_async` of the same pre-encoded bytes with the same
  `Nats-Msg-Id` header (dedup is server work every jetrl publish needs), then `fetch` + `ack`;
- bare: the same without the header, to show what server-side dedup costs.
Throughput is events per second end to end (publish all, then consume all); ratio = ours /
baseline, ratio_vs_bare = ours / bare. Ours does more per event (encode, decode and validate,
the in-flight budget) but takes its acks and pulls through nats-py's core API (its own inboxes),
which costs less per message than `publish_async` and `fetch` (a task or two each): where
the codec is cheap next to the transfer (4k tokens and up) the ratio can pass 1.

The codec figures compare our encode + decode (to a validated event) with a bare msgpack
pack + unpack of the same wire map (codec_ratio); validate_us is the pydantic validation
inside that decode (field types, nested tensors, and the poison checks of schemas.events),
and wire_ratio is the codec without it: what the byte format itself costs.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import statistics
import tempfile
import time
import timeit
from collections.abc import Callable
from pathlib import Path

import msgpack
import nats.errors
from nats.js import JetStreamContext

from bus.connection import connect
from bus.embedded import EmbeddedNats
from bus.publisher import Publisher
from bus.topology import TRAJECTORIES, Topology
from bus.worker import Worker, WorkerOptions
from schemas import Trajectories, TrajectoryEvent, decode, encode
from tests.helpers import trajectory


def events(run: str, count: int, tokens: int) -> list[TrajectoryEvent]:
    return [trajectory(run, prompt=i, tokens=tokens) for i in range(count)]


async def ours(js: JetStreamContext, run: str, evs: list[TrajectoryEvent]) -> float:
    topo = Topology(run=run)
    await topo.apply(js)
    start = time.perf_counter()
    publisher = Publisher(js, topo)
    acks = [await publisher.send(TRAJECTORIES, e) for e in evs]
    await asyncio.gather(*acks)
    done, stop, count = asyncio.Event(), asyncio.Event(), 0

    async def handler(event: Trajectories, _msg: object) -> None:
        nonlocal count
        count += 1
        if count == len(evs):
            done.set()

    options = WorkerOptions(concurrency=128)
    worker = Worker(js, topo, TRAJECTORIES, handler, publisher, options)
    task = asyncio.create_task(worker.run(stop))
    await done.wait()
    elapsed = time.perf_counter() - start
    stop.set()
    await task
    await publisher.close()
    await topo.delete(js)
    return len(evs) / elapsed


async def baseline(
    js: JetStreamContext, run: str, payloads: list[bytes], ids: list[str] | None
) -> float:
    topo = Topology(run=run)
    await topo.apply(js)
    subject = topo.subject(TRAJECTORIES)
    start = time.perf_counter()
    inflight: list[asyncio.Future] = []
    budget, used = 32 << 20, 0
    for index, data in enumerate(payloads):
        if used + len(data) > budget:
            await asyncio.gather(*inflight)
            inflight, used = [], 0
        headers = {"Nats-Msg-Id": ids[index]} if ids else None
        inflight.append(await js.publish_async(subject, data, headers=headers))
        used += len(data)
    await asyncio.gather(*inflight)
    # Plain nats-py's pull consumer, not `bus.pull`: the raw client call is what this baseline
    # measures the project's path against.
    sub = await js.pull_subscribe_bind(
        TRAJECTORIES.work_queue.durable, stream=topo.stream(TRAJECTORIES)
    )
    batch = max(1, min(128, (32 << 20) // len(payloads[0])))
    got = 0
    while got < len(payloads):
        try:
            msgs = await sub.fetch(batch, timeout=1.0)
        except nats.errors.TimeoutError:
            continue
        for msg in msgs:
            await msg.ack()
        got += len(msgs)
    elapsed = time.perf_counter() - start
    await sub.unsubscribe()
    await topo.delete(js)
    return len(payloads) / elapsed


def codec_us(event: TrajectoryEvent, number: int) -> tuple[float, float, float]:
    """Microseconds per encode + decode, of it pydantic validation, and bare pack + unpack.

    Each the best of 5 runs of `number` calls (timeit's convention: the minimum is the
    figure least disturbed by the rest of the machine), in this thread's CPU time: on 2 shared
    cores the wall clock counted the other jobs' turns too (2026-12-06, load 10: 26-158 µs of
    wall time for what took 23-47 µs of CPU).
    """
    wire = event.model_dump()

    def best(fn: Callable[[], object]) -> float:
        runs = timeit.repeat(fn, number=number, repeat=5, timer=time.thread_time)
        return min(runs) / number * 1e6

    return (
        best(lambda: decode(encode(event), TrajectoryEvent)),
        best(lambda: TrajectoryEvent.model_validate(wire)),
        best(lambda: msgpack.unpackb(msgpack.packb(wire))),
    )


async def main(quick: bool) -> dict:
    counts = (
        {1024: 2000, 4096: 1000, 16384: 400} if quick else {1024: 10000, 4096: 5000, 16384: 2000}
    )
    # Medians of several short alternating rounds: one round of a second or less swung the
    # ratio by ±0.15 on this shared machine.
    rounds = 5 if quick else 7
    figures: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory() as tmp, EmbeddedNats(Path(tmp)) as server:
        nc = await connect(server.url, "bench-bus")
        js = nc.jetstream()
        for tokens, count in counts.items():
            evs = events("bench", count, tokens)
            payloads = [encode(e) for e in evs]
            ids = [e.id for e in evs]
            # The inputs (~10^5 objects) are built before timing; left to the cyclic GC, each
            # full collection rescans them all (~0.1 s each), and whichever side allocates
            # more per event crosses that threshold more often: the figures then measure
            # the bench's own heap. Frozen, they are out of the collector's way for both sides.
            gc.collect()
            gc.freeze()
            ours_rates, base_rates, bare_rates = [], [], []
            for r in range(rounds):  # alternate so drift hits all three equally
                base_rates.append(await baseline(js, f"base{tokens}r{r}", payloads, ids))
                bare_rates.append(await baseline(js, f"bare{tokens}r{r}", payloads, None))
                ours_rates.append(await ours(js, f"ours{tokens}r{r}", evs))
            ours_codec, validate, bare_codec = codec_us(evs[0], 1000 if quick else 5000)
            figures[f"{tokens}"] = {
                "event_bytes": len(payloads[0]),
                "ours_per_s": round(statistics.median(ours_rates)),
                "baseline_per_s": round(statistics.median(base_rates)),
                "bare_per_s": round(statistics.median(bare_rates)),
                "ratio": round(statistics.median(ours_rates) / statistics.median(base_rates), 3),
                "ratio_vs_bare": round(
                    statistics.median(ours_rates) / statistics.median(bare_rates), 3
                ),
                "codec_us": round(ours_codec, 1),
                "bare_msgpack_us": round(bare_codec, 1),
                "codec_ratio": round(ours_codec / bare_codec, 2),
                "validate_us": round(validate, 1),
                "wire_ratio": round((ours_codec - validate) / bare_codec, 2),
            }
            print(f"{tokens:>6} tokens: {figures[str(tokens)]}", flush=True)
        await nc.close()
    return {
        "bench": "bus",
        "quick": quick,
        "sizes": figures,
        "ratio": min(f["ratio"] for f in figures.values()),
        "ratio_vs_bare": min(f["ratio_vs_bare"] for f in figures.values()),
        "codec_ratio": max(f["codec_ratio"] for f in figures.values()),
        "wire_ratio": max(f["wire_ratio"] for f in figures.values()),
    }


def plot(result: dict, out: Path) -> None:
    """bus.json and bus.png in `out`: events/s per size, ours beside both baselines."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    (out / "bus.json").write_text(json.dumps(result, indent=2) + "\n")
    sizes = list(result["sizes"])
    fig, ax = plt.subplots(figsize=(7, 4))
    bars = (
        ("ours_per_s", "jetrl publisher + worker"),
        ("baseline_per_s", "raw nats-py, Nats-Msg-Id"),
        ("bare_per_s", "raw nats-py, no header"),
    )
    for i, (key, label) in enumerate(bars):
        ax.bar(
            [x + (i - 1) * 0.27 for x in range(len(sizes))],
            [result["sizes"][n][key] for n in sizes],
            0.27,
            label=label,
        )
    for x, n in enumerate(sizes):
        ax.annotate(
            f"{result['sizes'][n]['ratio']:.2f}",
            (x - 0.27, result["sizes"][n]["ours_per_s"]),
            ha="center",
            va="bottom",
            fontsize=8,
        )
    ax.set_xticks(range(len(sizes)), [f"{n} tokens" for n in sizes])
    ax.set(
        ylabel="trajectory events / s (publish, consume, ack)",
        title="ops.bench.bus (labels: ours / baseline)",
    )
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "bus.png", dpi=110)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        prog="python -m ops.bench.bus", description=__doc__.splitlines()[0]
    )
    parser.add_argument("--quick", action="store_true", help="fewer events (about 20 s)")
    parser.add_argument(
        "--out", type=Path, help="also write bus.json and a bar chart, bus.png, into this directory"
    )
    args = parser.parse_args()
    figures = asyncio.run(main(args.quick))
    if args.out:
        plot(figures, args.out)
    print(json.dumps(figures))
