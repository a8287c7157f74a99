"""Weight versions as safetensors files in a directory the trainer and the rollout workers share.

    publish: <root>/.v<version>-<token>.safetensors.w<rank>.tmp, written and fsynced ->
             renamed to <root>/v<version>-<token>.safetensors (atomic: a reader sees the whole
             file or none) -> the directory fsynced -> all but the files of the `keep`
             versions written last deleted (each trainer rank prunes after its own shard)
    fetch:   the event's path (refused unless it is a file of <root>) opened with safetensors'
             `safe_open`, which maps it (mmap): tensors are views of the page cache, which the
             workers of one node share -> each checked against the manifest (names, dtypes,
             shapes, sha256), then handed to the engine, which copies them into the model

A new token per publish: a version published again (a trainer resumed from its checkpoint)
never overwrites a file that an event already announced with other checksums.

Deleting is safe for a reader that has the file open: its mapping keeps the bytes until it
lets go (POSIX; an NFS client keeps a deleted file it has open as `.nfsXXXX`). A reader that
comes to a version already deleted finds it missing (`WeightsMissing`) and, since newer
versions exist by then, moves on to them (`consumers.weights.receiver`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
from collections.abc import Callable, Collection
from pathlib import Path
from typing import ClassVar

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from consumers.weights.transport import Stored, WeightsMissing, WeightsUnavailable, to_delete
from engines.weight_retention import stale_payloads
from engines.weights import ChecksumMismatch, WeightsRefused, verify
from schemas.weight_event import TransportName, WeightShard, WeightVersionEvent

VERSION_FILE = re.compile(r"v(\d+)(?:-[0-9a-f]{8})?\.safetensors")
"""The files this transport writes (and prunes); any other file in the directory is left alone."""


def file_name(version: int) -> str:
    return f"v{version}-{secrets.token_hex(4)}.safetensors"


class FilesystemTransport:
    """Versions of one run as files under `root` (`<weights.dir>/<run>`),
    the last `keep` written kept."""

    name: ClassVar[TransportName] = "filesystem"

    def __init__(self, root: Path, keep: int = 3, writer: int = 0) -> None:
        """`writer`: the trainer rank writing through this transport (its temporary files'
        tag: each rank removes only its own leftovers)."""
        self.root = root
        self.keep = keep
        self._temp_suffix = f".safetensors.w{writer}.tmp"

    async def publish(
        self, version: int, tensors: dict[str, torch.Tensor], pinned: Collection[str] = ()
    ) -> Stored:
        return await asyncio.to_thread(
            self._write, version, lambda temp: save_file(tensors, temp), pinned
        )

    async def publish_bytes(
        self, version: int, data: bytes, pinned: Collection[str] = ()
    ) -> Stored:
        return await asyncio.to_thread(
            self._write, version, lambda temp: temp.write_bytes(data), pinned
        )

    def _write(
        self, version: int, write: Callable[[Path], object], pinned: Collection[str]
    ) -> Stored:
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / file_name(version)
        temp = self.root / f".{final.stem}{self._temp_suffix}"
        try:
            write(temp)
            with open(temp, "rb") as f:
                os.fsync(f.fileno())  # the bytes on disk before the name points at them
            os.replace(temp, final)
        finally:
            with contextlib.suppress(FileNotFoundError):
                temp.unlink()
        fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(fd)  # the rename itself survives a crash
        finally:
            os.close(fd)
        self._prune(final, {Path(p) for p in pinned})
        return Stored(str(final), final.stat().st_size)

    def _prune(self, written: Path, pinned: set[Path]) -> None:
        """Keep `written`, `pinned` (a delta chain's versions) and the files of the `keep - 1`
        versions written last before it (`to_delete`: by write time, a version being all its
        ranks' shards); delete the other version files, and the temporary files this writer
        left when it died mid-write (another rank's may be being written now)."""
        version = VERSION_FILE.fullmatch(written.name)
        assert version is not None, written
        stored = [
            (str(p), int(match.group(1)), p.stat().st_mtime_ns)
            for p in self.root.iterdir()
            if p != written and p not in pinned and (match := VERSION_FILE.fullmatch(p.name))
        ]
        doomed = [Path(p) for p in to_delete(stored, int(version.group(1)), self.keep)]
        doomed += [
            p
            for p in self.root.iterdir()
            if p.name.startswith(".v") and p.name.endswith(self._temp_suffix)
        ]
        for path in doomed:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    async def retain(self, kept: Collection[str], latest: int) -> list[str]:
        """Delete the version files up to `latest` not named in `kept`
        (`engines.weight_retention.stale_payloads`); the paths deleted."""
        return await asyncio.to_thread(self._retain, kept, latest)

    def _retain(self, kept: Collection[str], latest: int) -> list[str]:
        if not self.root.is_dir():
            return []
        stored = [
            (str(p), int(match.group(1)))
            for p in self.root.iterdir()
            if (match := VERSION_FILE.fullmatch(p.name))
        ]
        doomed = stale_payloads(stored, kept, latest)
        for path in doomed:
            with contextlib.suppress(FileNotFoundError):
                Path(path).unlink()
        return doomed

    async def fetch(self, event: WeightVersionEvent) -> dict[str, torch.Tensor]:
        return await asyncio.to_thread(self._read, event)

    def _inside(self, location: str) -> Path:
        path = Path(location)
        # An event may only point into this run's directory: not at any file a worker can read.
        if Path(os.path.realpath(path.parent)) != Path(os.path.realpath(self.root)):
            raise WeightsRefused(f"{path} is outside this run's weights directory {self.root}")
        return path

    async def fetch_bytes(self, shard: WeightShard) -> bytes:
        """A delta shard's payload, whole; its checks are the delta's own (`apply_delta`)."""
        return await asyncio.to_thread(self._read_bytes, shard)

    def _read_bytes(self, shard: WeightShard) -> bytes:
        path = self._inside(shard.location)
        try:
            data = path.read_bytes()
        except FileNotFoundError:
            raise WeightsMissing(f"{path} is missing (pruned, or never written)") from None
        except OSError as exc:
            raise WeightsUnavailable(f"{path}: {exc}") from None
        if len(data) != shard.total_bytes:
            raise ChecksumMismatch(
                f"{path} holds {len(data)} bytes, the event announced {shard.total_bytes}"
            )
        return data

    def _read(self, event: WeightVersionEvent) -> dict[str, torch.Tensor]:
        path = self._inside(event.location)
        try:
            with safe_open(path, framework="pt") as f:
                size = path.stat().st_size
                if size != event.total_bytes:
                    raise ChecksumMismatch(
                        f"{path} holds {size} bytes, the event announced {event.total_bytes}"
                    )
                tensors = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 - not a dict
        except FileNotFoundError:
            raise WeightsMissing(f"{path} is missing (pruned, or never written)") from None
        except SafetensorError as exc:
            raise ChecksumMismatch(f"{path} is not a safetensors file: {exc}") from None
        except OSError as exc:
            raise WeightsUnavailable(f"{path}: {exc}") from None
        verify(tensors, event.manifest)
        return tensors
