"""Fixtures: a real JetStream nats-server on a free loopback port, a fresh run per test,
a tiny model."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from nats.js.errors import NotFoundError

from bus.connection import connect
from bus.embedded import EmbeddedNats
from bus.topology import Topology


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    """One server for the session; tests isolate themselves by run id."""
    with EmbeddedNats(tmp_path_factory.mktemp("nats")) as server:
        yield server


@pytest.fixture(autouse=True)
def _release_session_streams(request: pytest.FixtureRequest) -> Iterator[None]:
    """Delete the streams a test made on the session's server once it ends.

    Every stream reserves its max_bytes against the server's max_file_store while it exists, so
    on one server for the whole session a few hundred finished runs exhaust it and every later
    test fails with "insufficient storage resources available"."""
    if "nats_server" not in request.fixturenames:
        yield
        return
    url = request.getfixturevalue("nats_server").url
    before = asyncio.run(_stream_names(url))
    yield
    asyncio.run(_delete_streams(url, keep=before))


async def _stream_names(url: str) -> set[str]:
    nc = await connect(url, "test-streams")
    try:
        return {
            info.config.name for info in await nc.jetstream().streams_info() if info.config.name
        }
    finally:
        await nc.close()


async def _delete_streams(url: str, keep: set[str]) -> None:
    nc = await connect(url, "test-streams")
    try:
        js = nc.jetstream()
        for name in await _stream_names(url) - keep:
            with contextlib.suppress(NotFoundError):
                await js.delete_stream(name)
    finally:
        await nc.close()


@pytest.fixture
def own_nats_server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    """A server for a test that stops or restarts it."""
    with EmbeddedNats(tmp_path / "nats") as server:
        yield server


@pytest.fixture
def topology() -> Topology:
    return Topology(run=f"t{uuid.uuid4().hex[:10]}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-init Qwen2 (seed 0) over the built-in tasks' vocabulary, with its tokenizer;
    built once per test module."""
    # Imported here: torch and transformers take seconds, and most test modules never need them.
    from engines.tiny import build_tiny_model
    from producers.tasks import VOCAB

    return build_tiny_model(tmp_path_factory.mktemp("tiny"), VOCAB)
