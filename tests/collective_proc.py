"""One participant of a collective weight broadcast, run as its own process by tests/test_collective.py.

    python -m tests.collective_proc source SETTINGS_JSON
    python -m tests.collective_proc receiver MEMBER_ID SETTINGS_JSON

Driven by JSON lines on stdin (the test plays the bus), answers JSON lines on stdout:
    source:   {"cmd": "publish", "version": V, "mb": MB, "alive": [ids]} -> {"event": "published", ...}
    receiver: {"event": "ready"} once started, then per command
              {"cmd": "receive", "host": H, "port": P, "version": V, "stall_at": K, "stall_s": S}
              -> {"event": "bucket", "k": K} per bucket, {"event": "stalled"} at bucket K (then it sleeps
              S s inside the progress callback: a member that stops reading), {"event": "received" | "missed"}
Every line ends with a flush so the test reads it at once.
"""

from __future__ import annotations

import hashlib
import json
import sys
import time

import torch

from engines.collective import CollectiveReceiver, CollectiveSettings, CollectiveSource, Received


def weights(version: int, mb: float) -> dict[str, torch.Tensor]:
    """A deterministic version of about `mb` MiB: mixed dtypes, odd sizes (alignment), a 0-dim tensor."""
    g = torch.Generator().manual_seed(version)
    n = int(mb * (1 << 20))
    return {
        "embed": torch.randn(n // 8, generator=g),  # fp32, half the bytes
        "layers.0.w": torch.randn(n // 4 + 3, generator=g).to(torch.bfloat16),  # bf16, the other half
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


def say(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def source(settings: CollectiveSettings) -> None:
    alive: list[str] = []
    src = CollectiveSource(lambda: alive, settings)
    say(event="address", host=src.address[0], port=src.address[1])
    for line in sys.stdin:
        cmd = json.loads(line)
        alive[:] = cmd["alive"]
        tensors = weights(cmd["version"], cmd["mb"])
        p = src.publish(cmd["version"], tensors)
        say(event="published", version=p.version, epoch=p.epoch, members=list(p.members), attempts=p.attempts,
            seconds=p.seconds, nbytes=p.nbytes, reason=p.reason, digest=digest(tensors))


def receiver(member_id: str, settings: CollectiveSettings) -> None:
    rcv = CollectiveReceiver(member_id, settings)
    say(event="ready")
    for line in sys.stdin:
        cmd = json.loads(line)
        stalls = [cmd["stall_at"]] if "stall_at" in cmd else []

        def progress(k: int, count: int, stalls: list[int] = stalls, stall_s: float = cmd.get("stall_s", 3600.0)) -> None:
            say(event="bucket", k=k, count=count)
            if k in stalls:  # once: a retry of the same version runs through
                stalls.clear()
                say(event="stalled")
                time.sleep(stall_s)

        got = rcv.receive((cmd["host"], cmd["port"]), cmd["version"], on_bucket=progress)
        if isinstance(got, Received):
            say(event="received", version=got.version, digest=digest(got.tensors), seconds=got.seconds,
                nbytes=got.nbytes)
        else:
            say(event="missed", version=got.version, reason=got.reason)


if __name__ == "__main__":
    if sys.argv[1] == "source":
        source(CollectiveSettings(**json.loads(sys.argv[2])))
    else:
        receiver(sys.argv[2], CollectiveSettings(**json.loads(sys.argv[3])))
