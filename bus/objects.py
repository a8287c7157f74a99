"""Large blobs through a JetStream object store, read as a stream of chunks, never whole.

nats-py's `ObjectStore.get` joins the chunks by appending each to a `bytes` object, so its
time grows with the square of the size (256 MB took 115 s here); with `writeinto` it pays
an executor call per chunk. Here the chunks of one object are read with public JetStream
calls only: the object's metadata (`ObjectStore.get_info`) names its chunk subject
`$O.<bucket>.C.<nuid>`, an ordered consumer on that subject delivers the chunks in stream
order, and each goes to the caller's `on_chunk(offset, data)` as it arrives (the caller
copies it where it belongs: a preallocated buffer). Writing uses nats-py's `put` with the
chunk size given (capped at the server's max payload): it is linear already.

No stage knowledge here: what the bytes mean, and how they are checked, is the caller's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from nats.aio.msg import Msg
from nats.js.api import ObjectInfo, ObjectMeta, ObjectMetaOptions
from nats.js.errors import BadObjectMetaError, NotFoundError

from bus.connection import JetStream

TICK = 0.5
"""Seconds between checks of a read that has stopped making progress."""


class ObjectMissing(LookupError):
    """The object is not there: never stored, deleted, or replaced
    (its chunks purged) while read."""


class ObjectCorrupt(ValueError):
    """The object's chunks do not add up to what its metadata says."""


class ObjectStalled(Exception):
    """No chunk of the object arrived for the stall limit; the object itself is still there."""


def chunk_subject(bucket: str, info: ObjectInfo) -> str:
    return f"$O.{bucket}.C.{info.nuid}"


async def put_object(
    js: JetStream, bucket: str, name: str, data: bytes, chunk_bytes: int
) -> ObjectInfo:
    """Store `data` as `name`, in chunks of `chunk_bytes` (at most the server's max payload).

    Each chunk is one awaited publish: with MiB chunks the round trips cost little, and the
    publishes never pile up past what the stream takes in."""
    size = max(1, min(chunk_bytes, js.client.max_payload))
    store = await js.object_store(bucket)
    return await store.put(
        name, data, meta=ObjectMeta(name=name, options=ObjectMetaOptions(max_chunk_size=size))
    )


async def object_info(js: JetStream, bucket: str, name: str) -> ObjectInfo:
    """The object's metadata; ObjectMissing if there is none (or it is deleted, or a link)."""
    store = await js.object_store(bucket)
    try:
        info = await store.get_info(name)
    except NotFoundError:
        raise ObjectMissing(f"object {name!r} is not in bucket {bucket}") from None
    except BadObjectMetaError:
        raise ObjectCorrupt(f"object {name!r}: unreadable metadata") from None
    if info.is_link() or not info.nuid:
        raise ObjectMissing(f"object {name!r} in bucket {bucket} is a link or has no chunks")
    return info


async def read_chunks(
    js: JetStream,
    bucket: str,
    info: ObjectInfo,
    on_chunk: Callable[[int, bytes], None],
    stall: float = 10.0,
) -> None:
    """Every chunk of the object `info` describes, in order, to `on_chunk(offset, data)`.

    Time is linear in the size: each chunk is handed over as it arrives and dropped. An
    exception from `on_chunk` ends the read at once and is raised here. When no chunk comes
    for a while, the object is looked up: gone or replaced -> ObjectMissing; still there
    but nothing for `stall` seconds -> ObjectStalled. Chunks that do not add up to the
    metadata's size and count -> ObjectCorrupt.
    """
    size, count = info.size or 0, info.chunks or 0
    if size == 0:
        return
    loop = asyncio.get_running_loop()
    done: asyncio.Future[None] = loop.create_future()
    offset = chunks = 0

    async def arrived(msg: Msg) -> None:
        nonlocal offset, chunks
        if done.done():
            return
        try:
            on_chunk(offset, msg.data)
        except Exception as exc:  # noqa: BLE001 - whatever the caller raises ends the read, raised by read_chunks
            done.set_exception(exc)
            return
        offset, chunks = offset + len(msg.data), chunks + 1
        if offset >= size or msg.metadata.num_pending == 0:
            done.set_result(None)

    sub = await js.subscribe(chunk_subject(bucket, info), ordered_consumer=True, cb=arrived)
    try:
        seen, since = 0, loop.time()
        while not done.done():
            try:
                async with asyncio.timeout(TICK):  # not wait_for, which can swallow a cancel
                    await asyncio.shield(done)
            except TimeoutError:
                if chunks != seen:
                    seen, since = chunks, loop.time()
                    continue
                now = await object_info(js, bucket, info.name)  # ObjectMissing if deleted meanwhile
                if now.nuid != info.nuid:
                    raise ObjectMissing(
                        f"object {info.name!r} was replaced while it was read"
                    ) from None
                if loop.time() - since >= stall:
                    raise ObjectStalled(
                        f"object {info.name!r}: no chunk for {stall:.0f} s "
                        f"after {offset} of {size} bytes"
                    ) from None
        done.result()
    finally:
        if not done.done():
            done.cancel()
        await sub.unsubscribe()
    if (offset, chunks) != (size, count):
        raise ObjectCorrupt(
            f"object {info.name!r}: {chunks} chunks of {offset} bytes, "
            f"its metadata says {count} of {size}"
        )


async def list_objects(js: JetStream, bucket: str) -> list[ObjectInfo]:
    """The bucket's objects that are not deleted."""
    store = await js.object_store(bucket)
    try:
        return await store.list(ignore_deletes=True)
    except NotFoundError:  # nats-py's answer for an empty bucket
        return []


async def delete_object(js: JetStream, bucket: str, name: str) -> None:
    """Delete `name` (its chunks purged); one already gone is no error."""
    store = await js.object_store(bucket)
    try:
        await store.delete(name)
    except NotFoundError:
        pass
