"""Fixtures: a real JetStream nats-server on a free loopback port, a fresh run per test, a tiny model."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from bus.embedded import EmbeddedNats
from bus.topology import Topology


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedNats]:
    """One server for the session; tests isolate themselves by run id."""
    with EmbeddedNats(tmp_path_factory.mktemp("nats")) as server:
        yield server


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
