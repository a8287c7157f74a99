"""The collective broadcast from two trainer ranks (gloo, each participant its own process).

Trainer rank 0 (`CollectiveSource`, senders 2) and rank 1 (`CollectivePeer`) each hold only
their own tensors of a version (`assign_shards`, as the FSDP trainer splits them); two rollout
receivers get the whole version bit for bit, and each counts the bytes that came from each src:

- every rank sent exactly its own tensors' bytes (with the stream's 64-byte alignment), and no
  rank sent the whole version;
- a receiver SIGKILLed mid-broadcast, in rank 1's buckets, costs one attempt on both senders;
  the group is rebuilt without it and the other receiver still gets the version;
- a receiver that stops reading there is dropped by both senders after the op timeout.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from engines.collective_plan import ALIGN
from tests.collective_proc import owned, weights
from tests.test_collective import DEADLINE_S, SETTINGS, STARTUP_S, VERSION_MB, Participant, spawn

pytestmark = pytest.mark.slow  # a minute or more of real runs: -m 'not slow' skips it

__all__ = ["spawn"]

SENDERS = 2


def own_bytes(version: int, mb: float) -> list[int]:
    """Stream bytes of each sender's own tensors, each padded to the stream's alignment."""
    return [
        sum(-(-t.nbytes // ALIGN) * ALIGN for t in mine.values())
        for mine in owned(weights(version, mb), SENDERS)
    ]


def start_ranks(spawn, *receivers: str) -> tuple[Participant, Participant, dict, list[Participant]]:
    src = spawn("source", str(SENDERS))
    peer = spawn("peer", "1", str(SENDERS))
    rcv = [spawn("receiver", r) for r in receivers]
    address = src.expect("address", within=STARTUP_S)
    for p in (peer, *rcv):
        p.expect("ready", within=STARTUP_S)
    return src, peer, {"host": address["host"], "port": address["port"]}, rcv


def test_two_trainer_ranks_each_send_their_own_tensors_to_two_receivers(spawn) -> None:
    src, peer, at, (a, b) = start_ranks(spawn, "a", "b")
    mb = 8
    for r in (a, b):
        r.send(cmd="receive", version=1, **at)
    src.send(cmd="publish", version=1, mb=mb, alive=["a", "b"])
    peer.send(cmd="publish", version=1, mb=mb, **at)
    sent = [src.expect("published", within=DEADLINE_S), peer.expect("published", within=DEADLINE_S)]
    for p in sent:
        assert p["members"] == ["a", "b"] and p["attempts"] == 1, p
    expected = own_bytes(1, mb)
    assert [p["sent"] for p in sent] == expected, (sent, expected)
    assert all(0 < n < 0.75 * sent[0]["nbytes"] for n in expected), (
        "a rank sent (nearly) the whole version"
    )
    for r in (a, b):
        got = r.expect("received", "missed", within=DEADLINE_S)
        assert got["event"] == "received", got
        assert got["digest"] == sent[0]["digest"], (
            "the version arrived different from the trainer's"
        )
        assert got["by_src"] == {"0": expected[0], "1": expected[1]}, got["by_src"]


def test_a_receiver_killed_in_rank_1s_buckets_leaves_the_other_with_the_version(spawn) -> None:
    src, peer, at, (a, b) = start_ranks(spawn, "a", "b")
    # Right after rank 1's first bucket (its tensors come second in the stream): rank 1 still has
    # more to send than loopback socket buffers hold, so b's death must break its broadcast.
    stall_at = -(-own_bytes(1, VERSION_MB)[0] // SETTINGS["bucket_bytes"])
    a.send(cmd="receive", version=1, **at)
    b.send(cmd="receive", version=1, stall_at=stall_at, **at)
    src.send(cmd="publish", version=1, mb=VERSION_MB, alive=["a", "b"])
    peer.send(cmd="publish", version=1, mb=VERSION_MB, **at)
    b.expect("stalled", within=DEADLINE_S)
    os.kill(b.proc.pid, signal.SIGKILL)

    published = [
        src.expect("published", within=DEADLINE_S),
        peer.expect("published", within=DEADLINE_S),
    ]
    got = a.expect("received", "missed", within=DEADLINE_S)
    assert got["event"] == "received" and got["digest"] == published[0]["digest"], got
    for p in published:
        assert p["members"] == ["a"] and p["attempts"] == 2, (
            p
        )  # the first attempt broke; rebuilt without b
    assert got["by_src"] == {"0": published[0]["sent"], "1": published[1]["sent"]}, (got, published)
    assert torch.tensor([p["sent"] for p in published]).gt(0).all()


def test_a_receiver_that_stops_reading_is_dropped_by_both_senders(spawn) -> None:
    """No socket closes: only the op timeout ends rank 1's bucket, and rank 0, waiting for that
    bucket from rank 1, times out too; both rebuild the group without the staller."""
    stall_s = 15.0
    src, peer, at, (a, b) = start_ranks(spawn, "a", "b")
    stall_at = -(-own_bytes(1, VERSION_MB)[0] // SETTINGS["bucket_bytes"])  # rank 1's first bucket
    a.send(cmd="receive", version=1, **at)
    b.send(cmd="receive", version=1, stall_at=stall_at, stall_s=stall_s, **at)
    src.send(cmd="publish", version=1, mb=VERSION_MB, alive=["a", "b"])
    peer.send(cmd="publish", version=1, mb=VERSION_MB, **at)
    b.expect("stalled", within=DEADLINE_S)

    published = [
        src.expect("published", within=DEADLINE_S),
        peer.expect("published", within=DEADLINE_S),
    ]
    got = a.expect("received", "missed", within=DEADLINE_S)
    for p in published:
        assert p["members"] == ["a"] and p["seconds"] < stall_s, p
    assert got["event"] == "received" and got["digest"] == published[0]["digest"], got
    assert b.expect("received", "missed", within=stall_s + DEADLINE_S)["event"] == "missed"
