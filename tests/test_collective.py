"""The collective weight transport over gloo: each participant its own process
(tests/collective_proc.py).

The test plays the bus: it tells the source whom `alive()` names and which version to publish,
and tells each receiver which version to expect. Every wait has a deadline of the test's own
(`Participant.expect`), so a broken timeout shows as a failed assertion, never as a hung pytest.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from engines.collective import (
    CollectiveReceiver,
    CollectiveSettings,
    CollectiveSource,
    Missed,
    Received,
)

pytestmark = pytest.mark.slow  # a minute or more of real runs: -m 'not slow' skips it

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {"bucket_bytes": 4 << 20, "op_timeout_s": 2.0, "join_timeout_s": 2.0}
VERSION_MB = 48
"""12 buckets: far more than loopback socket buffers hold,
so a member that stops reading stalls the source."""
STARTUP_S = 60.0
"""A participant's start (importing torch) on 2 busy cores."""
DEADLINE_S = 20.0
"""Longest a publish may take here: op + join timeouts are 4 s,
the 48 MB cross loopback in well under 1 s."""


class Participant:
    """A collective_proc child; its stdout lines are read by a thread so every wait has a
    deadline."""

    def __init__(self, tmp: Path, settings: dict, *args: str) -> None:
        self.name = (
            "source"
            if args[0] == "source"
            else args[1]
            if args[0] == "receiver"
            else f"peer{args[1]}"
        )
        self.log = tmp / f"{self.name}.stderr"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.collective_proc", *args, json.dumps(settings)],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.log.open("w"),
            text=True,
        )
        self.lines: queue.Queue[dict] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))

    def send(self, **cmd: object) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()

    def expect(self, *events: str, within: float) -> dict:
        """The next line whose event is one of `events`; fails the test after `within` seconds."""
        try:
            while (line := self.lines.get(timeout=within))["event"] not in events:
                pass
        except queue.Empty:
            pytest.fail(
                f"{self.name}: no {events} within {within:.0f} s; "
                f"stderr:\n{self.log.read_text()[-2000:]}"
            )
        return line


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator:
    started: list[Participant] = []

    def start(*args: str, settings: dict = SETTINGS) -> Participant:
        started.append(Participant(tmp_path, settings, *args))
        return started[-1]

    yield start
    for p in started:
        p.proc.kill()
        p.proc.wait()


def start_all(
    spawn, *receivers: str, settings: dict = SETTINGS
) -> tuple[Participant, dict, list[Participant]]:
    src = spawn("source", settings=settings)
    rcv = [spawn("receiver", r, settings=settings) for r in receivers]
    address = src.expect("address", within=STARTUP_S)
    for r in rcv:
        r.expect("ready", within=STARTUP_S)
    return src, {"host": address["host"], "port": address["port"]}, rcv


def test_a_member_killed_mid_broadcast_leaves_the_other_with_the_version(spawn) -> None:
    src, at, (a, b) = start_all(spawn, "a", "b")
    a.send(cmd="receive", version=1, **at)
    b.send(cmd="receive", version=1, stall_at=1, **at)  # stops reading after bucket 1 of 12 ...
    src.send(cmd="publish", version=1, mb=VERSION_MB, alive=["a", "b"])
    b.expect("stalled", within=DEADLINE_S)
    os.kill(b.proc.pid, signal.SIGKILL)  # ... and dies there, the source blocked on its socket

    published = src.expect("published", within=DEADLINE_S)
    got = a.expect("received", "missed", within=DEADLINE_S)
    assert got["event"] == "received", got
    assert got["digest"] == published["digest"]  # bit for bit
    assert published["members"] == ["a"]
    assert published["attempts"] == 2, (
        published
    )  # the first attempt broke mid-way; the group was rebuilt
    assert published["seconds"] < DEADLINE_S


def test_a_member_that_stops_reading_is_dropped_after_the_op_timeout(spawn) -> None:
    """No process dies, so no socket closes: only the broadcast's timeout can end the attempt."""
    stall_s = 12.0
    src, at, (a, b) = start_all(spawn, "a", "b")
    a.send(cmd="receive", version=1, **at)
    b.send(cmd="receive", version=1, stall_at=1, stall_s=stall_s, **at)
    src.send(cmd="publish", version=1, mb=VERSION_MB, alive=["a", "b"])
    b.expect("stalled", within=DEADLINE_S)

    published = src.expect("published", within=DEADLINE_S)
    got = a.expect("received", "missed", within=DEADLINE_S)
    # Without a timeout the source would wait for b to wake and deliver to both, stall_s late.
    assert published["members"] == ["a"], published
    assert published["seconds"] < stall_s, published
    assert got["event"] == "received" and got["digest"] == published["digest"], got
    late = b.expect("received", "missed", within=stall_s + DEADLINE_S)
    assert late["event"] == "missed", late  # it woke to a group rebuilt without it


def test_a_member_back_from_a_stall_rejoins_a_rebuilt_group(spawn) -> None:
    """Same members on the retry, yet a new epoch: the broken group is never used again."""
    settings = {**SETTINGS, "join_timeout_s": 6.0}
    src, at, (a, b) = start_all(spawn, "a", "b", settings=settings)
    a.send(cmd="receive", version=1, **at)
    # Wakes 2 s after the source's op timeout (2 s), well inside the retry's join window (2..8 s).
    b.send(cmd="receive", version=1, stall_at=1, stall_s=4.0, **at)
    src.send(cmd="publish", version=1, mb=VERSION_MB, alive=["a", "b"])
    published = src.expect("published", within=DEADLINE_S)
    assert published["members"] == ["a", "b"] and published["attempts"] == 2, published
    assert published["epoch"] == 2, published
    for r in (a, b):
        got = r.expect("received", "missed", within=DEADLINE_S)
        assert got["event"] == "received" and got["digest"] == published["digest"], got


def test_a_late_joiner_misses_a_version_then_gets_the_next(spawn) -> None:
    src, at, (a,) = start_all(spawn, "a")
    a.send(cmd="receive", version=1, **at)
    src.send(cmd="publish", version=1, mb=8, alive=["a"])
    first = src.expect("published", within=DEADLINE_S)
    assert a.expect("received", "missed", within=DEADLINE_S)["digest"] == first["digest"]

    c = spawn("receiver", "c")
    c.expect("ready", within=STARTUP_S)
    c.send(cmd="receive", version=1, **at)
    missed = c.expect("received", "missed", within=DEADLINE_S)
    assert missed["event"] == "missed" and "not a member" in missed["reason"], missed

    for r in (a, c):
        r.send(cmd="receive", version=2, **at)
    src.send(cmd="publish", version=2, mb=8, alive=["a", "c"])  # the heartbeats now list c
    second = src.expect("published", within=DEADLINE_S)
    assert second["members"] == ["a", "c"] and second["epoch"] == first["epoch"] + 1, second
    for r in (a, c):
        got = r.expect("received", "missed", within=DEADLINE_S)
        assert got["event"] == "received" and got["digest"] == second["digest"], got

    asked = time.monotonic()
    c.send(cmd="receive", version=0, **at)  # older than anything the source still holds
    stale = c.expect("received", "missed", within=DEADLINE_S)
    assert stale["event"] == "missed" and "superseded" in stale["reason"], stale
    assert (
        time.monotonic() - asked < SETTINGS["join_timeout_s"] / 2
    )  # told at once, not after the join timeout


class Tiny(torch.nn.Module):
    """Odd sizes, so tensors straddle 4 KiB buckets and need the stream's alignment padding."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.a = torch.nn.Linear(61, 37, dtype=dtype)
        self.b = torch.nn.Linear(37, 129, dtype=dtype)
        self.register_buffer(
            "scale", torch.ones(3, dtype=torch.bfloat16)
        )  # 6 bytes: the int64 after it needs padding
        self.register_buffer("count", torch.tensor([3, 1, 4], dtype=torch.int64))


def test_buckets_land_in_a_model_whole_or_not_at_all() -> None:
    """In one process (threads): fp32 tensors straddling buckets arrive bit for bit and are cast
    into a bf16 model; a failed checksum leaves the model as it was; a model that does not fit
    declines at once, without making the source wait out its join timeout."""
    settings = CollectiveSettings(bucket_bytes=4096, op_timeout_s=5.0, join_timeout_s=5.0)
    tensors = dict(Tiny(torch.float32).state_dict())
    src = CollectiveSource(lambda: ["r"], settings)
    rcv = CollectiveReceiver("r", settings)
    served = Tiny(torch.bfloat16)
    before = {k: v.clone() for k, v in served.state_dict().items()}
    with ThreadPoolExecutor(1) as pool:
        try:
            refused = pool.submit(rcv.receive, src.address, 1, served, {"b.bias": "0" * 64})
            assert src.publish(1, tensors).members == ("r",)
            missed = refused.result(timeout=30)
            assert isinstance(missed, Missed) and "checksum mismatch on b.bias" in missed.reason, (
                missed
            )
            assert all(torch.equal(before[n], t) for n, t in served.state_dict().items())

            loaded = pool.submit(rcv.receive, src.address, 2, served)
            assert src.publish(2, tensors).attempts == 1
            got = loaded.result(timeout=30)
            assert isinstance(got, Received), got
            assert got.tensors.keys() == tensors.keys()
            for name, t in tensors.items():
                assert torch.equal(got.tensors[name].view(torch.uint8), t.view(torch.uint8)), name
                assert torch.equal(served.state_dict()[name], t.to(before[name].dtype)), name

            declined = pool.submit(rcv.receive, src.address, 3, Tiny(torch.float32).a)
            third = src.publish(3, tensors)
            assert third.members == () and "no member" in third.reason, third
            assert third.seconds < settings.join_timeout_s / 2, third
            outcome = declined.result(timeout=30)
            assert isinstance(outcome, Missed) and "does not match the model" in outcome.reason
        finally:
            rcv.close()
            src.close()
