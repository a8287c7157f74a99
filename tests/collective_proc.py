"""One participant of a collective weight broadcast, run as its own process by
tests/test_collective.py.

    python -m tests.collective_proc source [SENDERS] SETTINGS_JSON
    python -m tests.collective_proc peer RANK SENDERS SETTINGS_JSON
    python -m tests.collective_proc receiver MEMBER_ID SETTINGS_JSON

Driven by JSON lines on stdin (the test plays the bus), answers JSON lines on stdout:
    source:   {"cmd": "publish", "version": V, "mb": MB, "alive": [ids]}
              -> {"event": "published", ...}
              (with SENDERS > 1 it sends only its own tensors of `weights`: `owned(...)[0]`)
    peer:     {"cmd": "publish", "host": H, "port": P, "version": V, "mb": MB}
              -> {"event": "published", ...}
              (trainer rank RANK: sends only `owned(...)[RANK]`)
    receiver: {"event": "ready"} once started, then per command
              {"cmd": "receive", "host": H, "port": P, "version": V, "stall_at": K, "stall_s": S}
              -> {"event": "bucket", "k": K} per bucket, {"event": "stalled"} at bucket K
              (then it sleeps S s inside the progress callback: a member that stops reading),
              {"event": "received" | "missed"}
Every line ends with a flush so the test reads it at once.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time

import torch

from engines.collective import (
    CollectiveReceiver,
    CollectiveSettings,
    CollectiveSource,
    Published,
    Received,
)
from engines.collective_peer import CollectivePeer
from engines.collective_plan import specs_of
from engines.delta_plan import assign_shards


def weights(version: int, mb: float) -> dict[str, torch.Tensor]:
    """A deterministic version of about `mb` MiB: mixed dtypes, odd sizes (alignment),
    a 0-dim tensor."""
    g = torch.Generator().manual_seed(version)
    n = int(mb * (1 << 20))
    return {
        "embed": torch.randn(n // 8, generator=g),  # fp32, half the bytes
        "layers.0.w": torch.randn(n // 4 + 3, generator=g).to(
            torch.bfloat16
        ),  # bf16, the other half
        "layers.0.b": torch.randn(37, generator=g),
        "mask": torch.rand(5, generator=g) > 0.5,
        "step": torch.tensor(version, dtype=torch.int64),
    }


def digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name]
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def owned(tensors: dict[str, torch.Tensor], senders: int) -> list[dict[str, torch.Tensor]]:
    """Each sender's own tensors, as the trainer splits them (`assign_shards` by bytes)."""
    layout = assign_shards({n: t.nbytes for n, t in tensors.items()}, senders)
    return [{n: tensors[n] for n in names} for names in layout]


def published(p: Published, tensors: dict[str, torch.Tensor]) -> None:
    say(
        event="published",
        version=p.version,
        epoch=p.epoch,
        members=list(p.members),
        attempts=p.attempts,
        seconds=p.seconds,
        nbytes=p.nbytes,
        reason=p.reason,
        sent=p.sent,
        digest=digest(tensors),
    )


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def source(settings: CollectiveSettings, senders: int) -> None:
    alive: list[str] = []
    src = CollectiveSource(lambda: alive, settings, senders=senders)
    say(event="address", host=src.address[0], port=src.address[1])
    for line in sys.stdin:
        cmd = json.loads(line)
        alive[:] = cmd["alive"]
        tensors = weights(cmd["version"], cmd["mb"])
        if senders == 1:
            published(src.publish(cmd["version"], tensors), tensors)
        else:  # the digest is the whole version's, to compare with what receivers got
            shards = owned(tensors, senders)
            published(
                src.publish(cmd["version"], shards[0], [specs_of(s) for s in shards]), tensors
            )


def peer(rank: int, settings: CollectiveSettings, senders: int) -> None:
    sender = CollectivePeer(rank, settings)
    say(event="ready")
    for line in sys.stdin:
        cmd = json.loads(line)
        tensors = weights(cmd["version"], cmd["mb"])
        mine = owned(tensors, senders)[rank]
        published(sender.publish((cmd["host"], cmd["port"]), cmd["version"], mine), tensors)


def receiver(member_id: str, settings: CollectiveSettings) -> None:
    rcv = CollectiveReceiver(member_id, settings)
    say(event="ready")
    for line in sys.stdin:
        cmd = json.loads(line)
        stalls = [cmd["stall_at"]] if "stall_at" in cmd else []

        def progress(
            k: int,
            count: int,
            stalls: list[int] = stalls,
            stall_s: float = cmd.get("stall_s", 3600.0),
        ) -> None:
            say(event="bucket", k=k, count=count)
            if k in stalls:  # once: a retry of the same version runs through
                stalls.clear()
                say(event="stalled")
                time.sleep(stall_s)

        got = rcv.receive((cmd["host"], cmd["port"]), cmd["version"], on_bucket=progress)
        if isinstance(got, Received):
            say(
                event="received",
                version=got.version,
                digest=digest(got.tensors),
                seconds=got.seconds,
                nbytes=got.nbytes,
                by_src={str(k): v for k, v in got.by_src.items()},
            )
        else:
            say(event="missed", version=got.version, reason=got.reason)


if __name__ == "__main__":
    if sys.argv[1] == "source":
        source(
            CollectiveSettings(**json.loads(sys.argv[-1])),
            int(sys.argv[2]) if len(sys.argv) > 3 else 1,
        )
    elif sys.argv[1] == "peer":
        peer(int(sys.argv[2]), CollectiveSettings(**json.loads(sys.argv[-1])), int(sys.argv[3]))
    else:
        receiver(sys.argv[2], CollectiveSettings(**json.loads(sys.argv[3])))
