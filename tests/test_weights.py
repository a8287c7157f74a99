"""Weight versions: bytes checked as they arrive, the object-store and filesystem transports
(real nats-server, real files), fetch time linear in size, and a short run over files.

- A payload received in pieces of any size gives the tensors bit for bit, as views of one
  buffer; the first tensor whose bytes are wrong is refused before the rest has arrived; a
  header that does not describe the manifest's tensors is refused.
- Object store and filesystem: a version round-trips bit for bit; bytes changed where they
  are stored, or a forged checksum, are refused; only the last `keep` versions are kept, a
  pruned one is missing (WeightsMissing), and one a reader already holds stays readable.
- Object-store fetch time grows linearly with the size (ratio of 4x the size to 1x, not a
  wall-clock limit).
- `weights.transport: filesystem` runs a job end to end: the rollout serves versions read
  from the run's weights directory.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from bus.connection import JetStream, connect
from bus.embedded import EmbeddedNats
from bus.objects import (
    ObjectMissing,
    ObjectStalled,
    delete_object,
    list_objects,
    object_info,
    read_chunks,
)
from bus.topology import Topology
from consumers.weights import WeightsMissing, publish_version
from consumers.weights.filesystem import FilesystemTransport
from consumers.weights.object_store import ObjectStoreTransport
from engines.weights import (
    ChecksumMismatch,
    Receiver,
    WeightsRefused,
    manifest_of,
    serialize,
)
from schemas import WeightVersionEvent
from schemas.config import ConfigError, parse_config
from schemas.weight_event import WeightShard, content_digest
from tests.helpers import run_local_job

MB = 1 << 20
# Bit patterns a float comparison would hide: -0.0, NaN (NaN != NaN), infinities, subnormals.
SPECIALS = [-0.0, float("nan"), float("inf"), -float("inf"), 1e-40]


def weights(nudge: float = 0.0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    embed = (torch.randn(64, 32, generator=generator) + nudge).to(torch.bfloat16)
    norm = torch.randn(32, generator=generator) + nudge
    embed[0, : len(SPECIALS)] = torch.tensor(SPECIALS).to(torch.bfloat16)
    norm[: len(SPECIALS)] = torch.tensor(SPECIALS)
    return {
        "model.embed_tokens.weight": embed,
        "model.norm.weight": norm,
        "model.empty": torch.zeros(0, 4),
    }


def bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.uint8)


def assert_bit_exact(loaded: dict[str, torch.Tensor], original: dict[str, torch.Tensor]) -> None:
    assert sorted(loaded) == sorted(original)
    for name, tensor in original.items():
        assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape, name
        assert torch.equal(bits(loaded[name]), bits(tensor)), name


# --- the receiver: pure, no bus ------------------------------------------------------------


@pytest.mark.parametrize("piece", [1, 7, 100, 4096, 1 << 30])
def test_a_payload_in_pieces_of_any_size_gives_the_tensors_bit_exactly_as_views(piece: int) -> None:
    original = weights()
    data = serialize(original)
    receiver = Receiver(manifest_of(original), len(data))
    for offset in range(0, len(data), piece):
        receiver.write(offset, data[offset : offset + piece])
        receiver.verify_through(offset + piece)
    loaded = receiver.tensors()
    assert_bit_exact(loaded, original)
    base = torch.frombuffer(
        receiver.buffer, dtype=torch.uint8
    ).data_ptr()  # nothing was copied out of it
    for name, tensor in loaded.items():
        if tensor.numel():
            assert base <= tensor.data_ptr() < base + len(data), (
                f"{name} is a copy, not a view of the buffer"
            )


def test_the_first_tampered_tensor_is_refused_before_the_rest_arrives() -> None:
    original = weights()
    data = bytearray(serialize(original))
    header_end = 8 + int.from_bytes(data[:8], "little")
    data[header_end] ^= 0x01  # the first byte of the first tensor's data
    receiver = Receiver(manifest_of(original), len(data))
    with pytest.raises(
        ChecksumMismatch, match=r"tensor model\.\S+ does not match its manifest entry"
    ):
        for offset in range(0, len(data), 256):
            receiver.write(offset, bytes(data[offset : offset + 256]))
            receiver.verify_through(offset + 256)
    assert receiver.received < len(data), "refused only once every byte was in"


@pytest.mark.parametrize("lie", ["shape", "extra tensor", "longer payload", "header length"])
def test_a_header_that_does_not_describe_the_manifest_is_refused(lie: str) -> None:
    original = weights()
    manifest = manifest_of(original)
    if lie == "shape":
        data = serialize(
            {**original, "model.norm.weight": original["model.norm.weight"].reshape(4, 8)}
        )
    elif lie == "extra tensor":
        data = serialize({**original, "extra": torch.zeros(2)})
    elif lie == "longer payload":
        data = serialize(original) + b"\x00" * 8
    else:
        data = (1 << 40).to_bytes(8, "little") + serialize(original)[8:]
    receiver = Receiver(manifest, len(data))
    receiver.write(0, data)
    with pytest.raises(ChecksumMismatch):
        receiver.tensors()


# --- object store ------------------------------------------------------------------------


def with_store(
    server: EmbeddedNats, topology: Topology, body: Callable[[JetStream], Awaitable[None]]
) -> None:
    async def main() -> None:
        nc = await connect(server.url, "test-weights")
        try:
            js = nc.jetstream()
            await topology.apply(js)
            await body(js)
        finally:
            await topology.delete(nc.jetstream())
            await nc.close()

    asyncio.run(main())


def test_object_store_version_round_trips_bit_exactly(
    nats_server: EmbeddedNats, topology: Topology
) -> None:
    async def body(js: JetStream) -> None:
        transport = ObjectStoreTransport(
            js, topology.object_bucket, chunk_bytes=1024
        )  # many chunks
        event = await publish_version(transport, topology.run, "test", 3, weights())
        assert (event.transport, event.version) == ("object_store", 3)
        assert event.id == f"{topology.run}/weights/3/{content_digest(event)}"
        assert_bit_exact(await transport.fetch(event), weights())
        assert [spec.dtype for spec in event.manifest] == ["bfloat16", "float32", "float32"]

    with_store(nats_server, topology, body)


def test_object_store_bytes_changed_in_the_store_are_refused(
    nats_server: EmbeddedNats, topology: Topology
) -> None:
    async def body(js: JetStream) -> None:
        transport = ObjectStoreTransport(js, topology.object_bucket, chunk_bytes=1024)
        event = await publish_version(transport, topology.run, "test", 3, weights())
        store = await js.object_store(topology.object_bucket)
        stored = bytearray((await store.get(event.location)).data or b"")
        stored[-1] ^= 0x01  # one bit of the last tensor's data: still a valid safetensors file
        await store.put(event.location, bytes(stored))
        with pytest.raises(
            ChecksumMismatch, match=r"tensor model\.\S+ does not match its manifest entry"
        ):
            await transport.fetch(event)
        forged = event.model_copy(
            update={
                "manifest": (
                    event.manifest[0].model_copy(update={"sha256": "0" * 64}),
                    *event.manifest[1:],
                )
            }
        )
        await store.put(event.location, serialize(weights()))  # the true bytes again
        with pytest.raises(
            ChecksumMismatch, match="tensor model.embed_tokens.weight does not match"
        ):
            await transport.fetch(forged)

    with_store(nats_server, topology, body)


def test_object_store_keeps_the_last_versions_and_a_pruned_one_is_missing(
    nats_server: EmbeddedNats, topology: Topology
) -> None:
    async def body(js: JetStream) -> None:
        transport = ObjectStoreTransport(js, topology.object_bucket, keep=2)
        events = [
            await publish_version(transport, topology.run, "test", v, weights(v)) for v in range(4)
        ]
        left = sorted(info.name for info in await list_objects(js, topology.object_bucket))
        assert left == sorted(e.location for e in events[-2:]), left
        with pytest.raises(WeightsMissing):
            await transport.fetch(events[0])
        assert_bit_exact(await transport.fetch(events[-1]), weights(3))

    with_store(nats_server, topology, body)


STALL_SECONDS = 8.0
"""The stall limit of the read below: it must end well before it."""


def test_an_object_deleted_while_it_is_read_ends_the_read_as_missing(
    nats_server: EmbeddedNats, topology: Topology
) -> None:
    """A version pruned while a worker reads it: the read ends, as missing, soon after the
    chunks stop (the object is looked up), not after the stall limit."""

    async def body(js: JetStream) -> None:
        transport = ObjectStoreTransport(js, topology.object_bucket, chunk_bytes=64 << 10)
        event = await publish_version(
            transport, topology.run, "test", 1, {"w": torch.zeros(64 * MB // 4)}
        )
        info = await object_info(js, topology.object_bucket, event.location)
        chunks: list[int] = []
        deleting: list[asyncio.Task[None]] = []

        def slowly(offset: int, data: bytes) -> None:
            chunks.append(offset)
            if len(chunks) == 1:
                deleting.append(
                    asyncio.get_running_loop().create_task(
                        delete_object(js, topology.object_bucket, event.location)
                    )
                )
            time.sleep(0.002)  # a slow reader: the deletion comes while most chunks are unread

        started = time.monotonic()
        try:
            await read_chunks(js, topology.object_bucket, info, slowly, stall=STALL_SECONDS)
            ended: Exception | None = None
        except (ObjectMissing, ObjectStalled) as exc:
            ended = exc
        seconds = time.monotonic() - started
        assert isinstance(ended, ObjectMissing), (
            f"the read ended with {ended!r} after {seconds:.1f} s"
        )
        assert seconds < STALL_SECONDS, "the read waited for the stall limit"
        assert info.chunks is not None  # a stored object's info counts its chunks
        assert len(chunks) < info.chunks, (
            f"all {info.chunks} chunks were read: the deletion came too late to tell"
        )
        await deleting[0]

    with_store(nats_server, topology, body)


SIZES_MB = (16, 64)
LINEAR_LIMIT = 6.0
"""Fetch time at 4x the size over the time at 1x: about 4 if linear, 16 if quadratic (nats-py's
`get`, which joins the chunks into one `bytes`, measured ~13 here). 6 leaves room for a shared
machine's noise."""
LINEAR_CHUNK = 128 << 10
"""Small chunks (nats-py's default), so that there are many (512 at 64 MB): a join that copies
what came before at each chunk costs in their number squared, and big chunks would hide it
(nats-py's `get` of 64 MB in 8 MiB chunks is only 8 joins)."""


def test_object_store_fetch_time_is_linear_in_size(
    nats_server: EmbeddedNats, topology: Topology
) -> None:
    seconds: dict[int, float] = {}

    async def body(js: JetStream) -> None:
        transport = ObjectStoreTransport(
            js, topology.object_bucket, chunk_bytes=LINEAR_CHUNK, keep=1
        )
        for size in SIZES_MB:
            numel = size * MB // 4
            tensors = {
                "a.weight": torch.randn(numel // 2),
                "b.weight": torch.randn(numel - numel // 2),
            }
            event = await publish_version(transport, topology.run, "test", size, tensors)
            times = []
            for _ in range(3):
                started = time.perf_counter()
                got = await transport.fetch(event)
                times.append(time.perf_counter() - started)
                assert got["a.weight"].shape == tensors["a.weight"].shape
                del got
            seconds[size] = statistics.median(times)

    with_store(nats_server, topology, body)
    small, large = SIZES_MB
    ratio = seconds[large] / seconds[small]
    print(
        f"fetch {small} MB {seconds[small]:.3f} s, {large} MB {seconds[large]:.3f} s, "
        f"ratio {ratio:.2f}"
    )
    assert ratio < LINEAR_LIMIT, (
        f"fetch of {large} MB took {seconds[large]:.2f} s, {ratio:.1f}x the {seconds[small]:.2f} s "
        f"of {small} MB ({large // small}x the size): not linear"
    )


# --- filesystem --------------------------------------------------------------------------


def fs_publish(
    transport: FilesystemTransport, version: int, tensors: dict[str, torch.Tensor]
) -> WeightVersionEvent:
    return asyncio.run(publish_version(transport, "r", "test", version, tensors))


def test_filesystem_version_round_trips_bit_exactly_written_atomically(tmp_path: Path) -> None:
    transport = FilesystemTransport(tmp_path / "r")
    event = fs_publish(transport, 5, weights())
    path = Path(event.location)
    assert (
        event.transport == "filesystem"
        and path.parent == tmp_path / "r"
        and path.name.startswith("v5-")
    )
    assert event.total_bytes == path.stat().st_size
    assert [p.name for p in (tmp_path / "r").iterdir()] == [path.name], (
        "a temporary file was left behind"
    )
    assert_bit_exact(asyncio.run(transport.fetch(event)), weights())


@pytest.mark.parametrize("damage", ["bit flipped", "truncated", "not safetensors"])
def test_filesystem_damaged_file_is_refused(tmp_path: Path, damage: str) -> None:
    transport = FilesystemTransport(tmp_path / "r")
    event = fs_publish(transport, 5, weights())
    path = Path(event.location)
    data = bytearray(path.read_bytes())
    if damage == "bit flipped":
        data[-1] ^= 0x01  # the last tensor's data: still a valid safetensors file of the same size
    elif damage == "truncated":
        data = data[:-4]
    else:
        data = bytearray(b"\x00" * len(data))
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatch):
        asyncio.run(transport.fetch(event))


def test_filesystem_refuses_a_location_outside_the_run_directory(tmp_path: Path) -> None:
    transport = FilesystemTransport(tmp_path / "r")
    event = fs_publish(transport, 5, weights())
    elsewhere = tmp_path / "elsewhere.safetensors"
    elsewhere.write_bytes(Path(event.location).read_bytes())
    for location in (
        str(elsewhere),
        str(tmp_path / "r" / "sub" / ".." / ".." / "elsewhere.safetensors"),
    ):
        with pytest.raises(WeightsRefused, match="outside this run's weights directory"):
            asyncio.run(transport.fetch(event.model_copy(update={"location": location})))


def test_filesystem_keeps_the_last_versions_and_a_reader_keeps_what_it_opened(
    tmp_path: Path,
) -> None:
    transport = FilesystemTransport(tmp_path / "r", keep=2)
    first = fs_publish(transport, 0, weights(0))
    held = asyncio.run(transport.fetch(first))  # a worker mid-load: the file mapped
    events = [first] + [fs_publish(transport, v, weights(v)) for v in (1, 2, 3)]
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == sorted(
        Path(e.location).name for e in events[-2:]
    )
    assert_bit_exact(held, weights(0))  # its file is gone, its mapping is not
    with pytest.raises(WeightsMissing):
        asyncio.run(transport.fetch(first))
    # Write order, not version: a trainer resumed from an older checkpoint publishes v1 again,
    # and its events announce that one.
    again = fs_publish(transport, 1, weights(1))
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == sorted(
        Path(e.location).name for e in (events[-1], again)
    )


def test_each_rank_prunes_by_versions_and_keeps_the_other_ranks_shards_and_temp_files(
    tmp_path: Path,
) -> None:
    """Two trainer ranks write a shard of every version into one directory, each pruning after
    its own write: the shards of the `keep` versions written last stay, all of them, and a
    rank removes only its own leftover temporary files (the other's may be mid-write)."""
    root = tmp_path / "r"
    ranks = [FilesystemTransport(root, keep=2, writer=w) for w in (0, 1)]
    root.mkdir()
    (root / ".v9-0a0b0c0d.safetensors.w1.tmp").write_bytes(b"rank 1 writing")
    (root / ".v8-0a0b0c0d.safetensors.w0.tmp").write_bytes(b"rank 0 died here")
    first = Path(asyncio.run(ranks[0].publish(0, weights(0))).location).name
    assert sorted(p.name for p in root.iterdir()) == sorted(
        [".v9-0a0b0c0d.safetensors.w1.tmp", first]
    )
    written = {
        (v, w): Path(asyncio.run(t.publish(v, weights(v))).location).name
        for v in range(1, 4)
        for w, t in enumerate(ranks)
    }
    assert sorted(p.name for p in root.iterdir()) == sorted(
        written[v, w] for v in (2, 3) for w in (0, 1)
    )


# --- config and event --------------------------------------------------------------------


def test_weights_config_is_checked_at_load() -> None:
    assert parse_config({"weights": {"transport": "collective"}}).weights.fallback == "object_store"
    with pytest.raises(
        ConfigError, match=r"^config: weights: .*collective broadcasts full versions"
    ):
        parse_config({"weights": {"transport": "collective", "delta": True}})
    with pytest.raises(ConfigError, match=r"^config: weights\.collective: .*nccl needs cuda:N"):
        parse_config({"weights": {"transport": "collective", "collective": {"backend": "nccl"}}})
    with pytest.raises(ConfigError, match=r"^config: weights\.fallback: "):
        parse_config({"weights": {"transport": "collective", "fallback": "collective"}})
    with pytest.raises(
        ConfigError, match=r"^config: weights\.collective\.join_timeout: Extra inputs"
    ):
        parse_config({"weights": {"collective": {"join_timeout": 3}}})
    with pytest.raises(ConfigError, match=r"^config: weights\.chunk_mib:"):
        parse_config({"weights": {"chunk_mib": 0}})
    with pytest.raises(
        ConfigError,
        match=r"^config: weights\.full_every: Input should be greater than or equal to 1",
    ):
        parse_config({"weights": {"delta": True, "full_every": 0}})
    with pytest.raises(
        ConfigError, match=r"^config: weights\.delta: Input should be a valid boolean"
    ):
        parse_config({"weights": {"delta": "sometimes"}})
    assert parse_config({"weights": {"delta": True, "full_every": 4}}).weights.full_every == 4
    assert parse_config({"weights": {"transport": "filesystem", "dir": "/w"}}).weights.dir == "/w"


def test_weight_event_says_where_its_bytes_are_or_is_refused() -> None:
    base: dict[str, Any] = {
        "id": "r/weights/1",
        "run": "r",
        "version": 1,
        "step": 1,
        "total_bytes": 64,
        "manifest": manifest_of({"w": torch.zeros(4, 4)}),
    }
    assert WeightVersionEvent(**base, transport="nccl", location="group0").transport == "collective"
    WeightVersionEvent(**base, transport="filesystem", location="/w/r/v1-0a0b0c0d.safetensors")
    for transport, location, why in [
        ("filesystem", "w/r/v1.safetensors", "absolute path"),
        ("filesystem", "/w/../etc/v1.safetensors", "absolute path"),
        ("filesystem", "/w/r/v1.bin", "absolute path"),
        ("object_store", "../v1.safetensors", "not an object name"),
    ]:
        with pytest.raises(ValidationError, match=why):
            WeightVersionEvent(**base, transport=transport, location=location)
    with pytest.raises(ValidationError, match="names a tensor twice"):
        WeightVersionEvent(**{**base, "manifest": base["manifest"] * 2}, location="v1.safetensors")
    with pytest.raises(ValidationError, match="less than the manifest's 64 bytes"):
        WeightVersionEvent(**{**base, "total_bytes": 63}, location="v1.safetensors")
    with pytest.raises(ValidationError, match="must be older than version"):
        WeightVersionEvent(**base, base_version=1, location="v1.safetensors")
    collective = {
        **base,
        "transport": "collective",
        "location": "10.0.0.1:29500",
        "fallback_transport": "filesystem",
    }
    assert WeightVersionEvent(
        **collective, fallback_location="/w/r/v1-0a0b0c0d.safetensors"
    ).fallback_location
    with pytest.raises(ValidationError, match="absolute path"):
        WeightVersionEvent(**collective, fallback_location="v1.safetensors")
    with pytest.raises(ValidationError, match="come together"):
        WeightVersionEvent(**collective)
    with pytest.raises(ValidationError, match="for collective versions, not object_store"):
        WeightVersionEvent(
            **{**collective, "transport": "object_store", "location": "v1.safetensors"},
            fallback_location="/w/r/v1-0a0b0c0d.safetensors",
        )


def test_a_delta_event_names_its_chain_and_shards_or_is_refused() -> None:
    base: dict[str, Any] = {
        "id": "r/weights/3",
        "run": "r",
        "version": 3,
        "step": 3,
        "location": "v3-0a0b0c0d.safetensors",
        "manifest": manifest_of({"w": torch.zeros(4, 4), "b": torch.zeros(4)}),
    }
    shard = WeightShard(location="v3-0a0b0c0d.safetensors", total_bytes=20, tensors=("w", "b"))
    delta = {**base, "base_version": 2, "full_version": 0, "total_bytes": 20, "shards": (shard,)}
    assert WeightVersionEvent(**delta).total_bytes == 20  # less than the tensors' data: a delta
    assert WeightVersionEvent(**{**base, "total_bytes": 80}, full_version=3).full_version == 3
    changes: list[tuple[dict[str, Any], str | None]] = [
        ({"full_version": None}, "needs its chain's full version"),
        ({"full_version": 2, "base_version": 2}, None),  # a delta on its chain's full version
        ({"full_version": 3}, "needs its chain's full version"),
        ({"shards": ()}, "needs its shards"),
        (
            {"shards": (shard.model_copy(update={"tensors": ("w",)}),)},
            "each manifest tensor exactly once",
        ),
        (
            {"shards": (shard.model_copy(update={"tensors": ("w", "b", "w")}),)},
            "each manifest tensor exactly once",
        ),
        ({"total_bytes": 21}, "the shards' sum"),
        ({"shards": (shard.model_copy(update={"location": "../x"}),)}, "not an object name"),
    ]
    for change, why in changes:
        if why is None:
            WeightVersionEvent(**{**delta, **change})
            continue
        with pytest.raises(ValidationError, match=why):
            WeightVersionEvent(**{**delta, **change})
    with pytest.raises(ValidationError, match="own chain's full version"):
        WeightVersionEvent(**{**base, "total_bytes": 80}, full_version=0)


def test_a_sharded_full_version_carries_each_tensor_once_or_is_refused() -> None:
    """Several trainer ranks each store their tensors of a full version: the event lists the
    shards, which must cover its manifest exactly once (no overlap, none missing)."""
    full = {
        "id": "r/weights/3",
        "run": "r",
        "version": 3,
        "step": 3,
        "location": "v3-0a0b0c0d.safetensors",
        "manifest": manifest_of({"w": torch.zeros(4, 4), "b": torch.zeros(4), "c": torch.zeros(2)}),
        "full_version": 3,
        "total_bytes": 200,
    }
    rank0 = WeightShard(location="v3-0a0b0c0d.safetensors", total_bytes=120, tensors=("w",))
    rank1 = WeightShard(location="v3-1a1b1c1d.safetensors", total_bytes=80, tensors=("b", "c"))
    assert WeightVersionEvent(**full, shards=(rank0, rank1)).shards[1].tensors == ("b", "c")
    assert (
        WeightVersionEvent(**{**full, "full_version": None}, shards=(rank0, rank1)).full_version
        is None
    )
    for shards, why in [
        (
            (rank0, rank1.model_copy(update={"tensors": ("b",)})),
            "each manifest tensor exactly once",
        ),  # c missing
        (
            (rank0, rank1.model_copy(update={"tensors": ("w", "b", "c")})),
            "each manifest tensor exactly once",
        ),
        (
            (rank0, rank1.model_copy(update={"tensors": ("b", "c", "x")})),
            "each manifest tensor exactly once",
        ),
        ((rank1, rank0), "its first shard's and the shards' sum"),
        ((rank0, rank1.model_copy(update={"total_bytes": 81})), "the shards' sum"),
        ((rank0, rank1.model_copy(update={"location": "../x"})), "not an object name"),
    ]:
        with pytest.raises(ValidationError, match=why):
            WeightVersionEvent(**full, shards=shards)
    with pytest.raises(ValidationError, match="shards are those of its fallback copy"):
        WeightVersionEvent(
            **{**full, "transport": "collective", "location": "h:1"}, shards=(rank0, rank1)
        )
    # A collective version's shards are its fallback copy's: checked against fallback_location.
    collective = {
        **full,
        "transport": "collective",
        "location": "h:1",
        "fallback_transport": "object_store",
    }
    assert (
        WeightVersionEvent(
            **collective, fallback_location=rank0.location, shards=(rank0, rank1)
        ).location
        == "h:1"
    )
    with pytest.raises(ValidationError, match="its first shard's"):
        WeightVersionEvent(**collective, fallback_location=rank1.location, shards=(rank0, rank1))


# --- a short run over files --------------------------------------------------------------


def short_run(tmp_path: Path, weights: dict, steps: int) -> tuple[str, Path]:
    """A whole run of `steps` steps (`producers.prompts` starts every role) with `weights`;
    (run, out)."""
    run = f"fs{uuid.uuid4().hex[:8]}"
    config = {
        "run": run,
        "model": {"hidden": 32, "layers": 1},
        "data": {"n": 4, "sampling": {"max_tokens": 6}},
        "algorithm": {"prompts_per_step": 2},
        "reward": {"processes": 1},
        "weights": weights,
    }
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OTEL_", "JETRL_"))}
    out = run_local_job(config, tmp_path, steps, timeout=200, env=env).out
    assert (out / "weights" / run).is_dir(), f"no weights directory for run {run} under {out}"
    return run, out


@pytest.mark.timeout(240)
def test_a_run_with_filesystem_transport_serves_versions_from_files(tmp_path: Path) -> None:
    steps = 3
    run, out = short_run(tmp_path, {"transport": "filesystem", "keep": 10}, steps)
    files = sorted(p.name for p in (out / "weights" / run).iterdir())
    assert all(name.endswith(".safetensors") for name in files), files
    # Only what the rollout worker may still load: v3, and v2 if it was still fetching it
    # (`engines.weight_retention`), though `keep` is 10.
    assert f"v{steps}" in {name.split("-")[0] for name in files}, files
    assert {name.split("-")[0] for name in files} <= {f"v{steps - 1}", f"v{steps}"}, files
    served = (out / "logs" / "rollout-0.log").read_text()
    assert "now serving weights v1" in served, served[-3000:]
    assert "weights refused" not in served, served[-3000:]


@pytest.mark.timeout(240)
def test_a_run_with_delta_versions_serves_every_version_and_keeps_the_chain(tmp_path: Path) -> None:
    """v0 full, v1..v3 deltas on it: the rollout serves v3 (each delta checked against its
    checksum), and the whole chain is kept though `keep` is 2."""
    steps = 3
    run, out = short_run(
        tmp_path, {"transport": "filesystem", "keep": 2, "delta": True, "full_every": 4}, steps
    )
    files = sorted(p.name for p in (out / "weights" / run).iterdir())
    assert {name.split("-")[0] for name in files} == {f"v{v}" for v in range(steps + 1)}, files
    sizes = {name.split("-")[0]: (out / "weights" / run / name).stat().st_size for name in files}
    assert all(sizes[f"v{v}"] < sizes["v0"] for v in range(1, steps + 1)), sizes
    served = (out / "logs" / "rollout-0.log").read_text()
    assert f"now serving weights v{steps}" in served, served[-3000:]
    assert "weights refused" not in served and "not loaded" not in served, served[-3000:]
