"""Per-role NATS users (bus.security) on a real server, and TLS through `bus.connection.connect`.

The users block is written by the CLI (`python -m ops.streams users`) and included by the
server's config, as the cluster example configs tell users to do. Each role then does what
its code does on the bus, through the same calls (`bus.runtime.attach` itself for the
start-up), and must meet no permissions violation; then the forbidden writes are refused.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import shutil
import ssl
import subprocess
import sys
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import nats.errors
import pytest
import torch
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy

from bus.connection import ConnectRefused, connect
from bus.embedded import EmbeddedNats
from bus.identity import IDENTITY_ENV, identity_path, new_seed, public_key, write_private
from bus.lag import queue_lag
from bus.objects import list_objects
from bus.publisher import Publisher
from bus.runtime import Runtime, attach, publish_config
from bus.security import USERS_FILE, roles
from bus.topology import (
    BATCHES,
    PROMPTS,
    REWARDS,
    TRAJECTORIES,
    WEIGHTS,
    Channel,
    Topology,
    drop_key,
    metrics_key,
)
from bus.worker import Worker, WorkerOptions
from consumers.weights import publish_version
from consumers.weights.object_store import ObjectStoreTransport
from producers.stall_view import read_view
from schemas import Event, PromptEvent, Rewards, Trajectories
from schemas.config import RunConfig
from tests.helpers import messages, prompt, reward, trajectory

ROOT = Path(__file__).resolve().parent.parent
E = TypeVar("E", bound=Event)
# nats-py lower-cases the server's error line.
VIOLATION = "permissions violation"


@dataclass(frozen=True)
class Secured:
    server: EmbeddedNats
    topology: Topology
    identities: Path

    @property
    def url(self) -> str:
        return self.server.url

    def identity(self, role: str) -> Path:
        return identity_path(role, self.identities)


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    """A server whose config includes the users block the CLI wrote for a fresh run; the
    roles' seed files beside it."""
    topology = Topology(run=f"s{uuid.uuid4().hex[:10]}")
    store = tmp_path_factory.mktemp("secured")
    subprocess.run(
        [sys.executable, "-m", "ops.streams", "users", "--run", topology.run, "--out", str(store)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        timeout=60,
    )
    # `include` paths are relative to the including file: the server's config sits in `store`.
    with EmbeddedNats(store, extra_config='include "users.conf"\n') as server:
        yield Secured(server, topology, store)


def violations(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if VIOLATION in r.getMessage()]


async def work_one(
    rt: Runtime, channel: Channel[E], handle: Callable[[E], Awaitable[None]]
) -> None:
    """Serve the channel's work queue until the handler has run once."""
    done = asyncio.Event()

    async def handler(event: E, msg: Msg) -> None:
        await handle(event)
        done.set()

    stop = asyncio.Event()
    worker = Worker(
        rt.js, rt.topology, channel, handler, rt.publisher, WorkerOptions(fetch_timeout=0.5)
    )
    task = asyncio.create_task(worker.run(stop))
    await asyncio.wait_for(done.wait(), 10)
    stop.set()
    await task


async def read_one(js: JetStreamContext, subject: str, **options: object) -> bytes:
    sub = await js.subscribe(subject, ordered_consumer=True, **options)  # type: ignore[arg-type]
    data = (await sub.next_msg(timeout=5)).data
    await sub.unsubscribe()
    return data


def test_every_role_does_its_job_with_its_own_credential(
    secured: Secured, caplog: pytest.LogCaptureFixture
) -> None:
    t, run = secured.topology, secured.topology.run
    caplog.set_level(logging.WARNING)

    async def scenario() -> None:
        # Producer: creates the run, writes the config and a prompt, resumes, watches.
        nc = await connect(secured.url, "producer-bootstrap", identity=secured.identity("producer"))
        await t.apply(nc.jetstream())
        await publish_config(await nc.jetstream().key_value(t.kv_bucket), RunConfig(run=run))
        await nc.close()
        producer = await attach("producer", run, secured.url, identity=secured.identity("producer"))
        await producer.publisher.publish(PROMPTS, prompt(run, 0))
        assert (await producer.js.get_last_msg(t.stream(PROMPTS), t.subject(PROMPTS))).data
        lags = await queue_lag(producer.js, t)  # the progress line's figures
        assert None not in lags.values(), lags

        # Trainer: weight bytes to the object store in chunks, older versions pruned, the
        # version announced (as bytes: what a reader does with them is not the point here).
        trainer = await attach("trainer", run, secured.url, identity=secured.identity("trainer"))
        publishing = ObjectStoreTransport(trainer.js, t.object_bucket, chunk_bytes=64 << 10, keep=1)
        tensors = {"w": torch.arange(100_000, dtype=torch.float32)}  # several chunks
        await publish_version(publishing, run, trainer.source, 0, {"w": torch.zeros(10)})
        event = await publish_version(publishing, run, trainer.source, 1, tensors)  # v0 pruned
        assert [i.name for i in await list_objects(trainer.js, t.object_bucket)] == [event.location]
        await trainer.js.publish(t.subject(WEIGHTS), b"version 0")

        # Rollout: a prompt from its queue -> a trajectory; follows weights and reads their bytes.
        rollout = await attach("rollout", run, secured.url, identity=secured.identity("rollout"))

        async def generate(event: PromptEvent) -> None:
            await rollout.publisher.publish(TRAJECTORIES, trajectory(run, event.index))

        await work_one(rollout, PROMPTS, generate)
        assert (
            await read_one(rollout.js, t.subject(WEIGHTS), deliver_policy=DeliverPolicy.LAST)
            == b"version 0"
        )
        fetched = await ObjectStoreTransport(rollout.js, t.object_bucket).fetch(event)
        assert torch.equal(fetched["w"], tensors["w"])
        assert (
            await rollout.js.get_last_msg(t.stream(WEIGHTS), t.subject(WEIGHTS))
        ).data == b"version 0"

        # Reward: a trajectory from its queue -> a reward.
        scorer = await attach("reward", run, secured.url, identity=secured.identity("reward"))

        async def score(event: Trajectories) -> None:
            await scorer.publisher.publish(REWARDS, reward(run, 0))

        await work_one(scorer, TRAJECTORIES, score)

        # Buffer: a reward from its queue -> a batch and a drop record; replays the batches.
        buffer = await attach("buffer", run, secured.url, identity=secured.identity("buffer"))

        async def batch(event: Rewards) -> None:
            await buffer.kv.create(drop_key(f"{run}/0/1"), b"all rewards equal")
            await buffer.js.publish(t.subject(BATCHES, 0), b"batch 0")

        await work_one(buffer, REWARDS, batch)
        assert await read_one(buffer.js, t.subject(BATCHES, ">")) == b"batch 0"

        # Trainer: its rank's batches by position, then metrics.
        config = ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=1)
        assert await read_one(trainer.js, t.subject(BATCHES, 0), config=config) == b"batch 0"
        await trainer.kv.put(metrics_key(0, 0), b"{}")

        # Producer: the admission gate follows weights and the KV.
        assert (
            await read_one(producer.js, t.subject(WEIGHTS), deliver_policy=DeliverPolicy.LAST)
            == b"version 0"
        )
        watcher = await producer.kv.watch(">")
        assert (await watcher.updates(timeout=5)) is not None
        await watcher.stop()
        # Producer: naming a stall reads members, queues and the batch stream's tail.
        stall = await read_view(
            producer.js, t, producer.config, next_step=0, issued=1, version=0, dropped=0
        )
        assert stall.live is not None and stall.live["buffer"] == 1, (
            f"the members as the producer reads them: {stall.live}"
        )
        assert None not in stall.queues.values(), (
            f"the work queues as the producer reads them: {stall.queues}"
        )

        # Trainer: deletes the batches its committed checkpoint no longer needs (`Trainer.trim`).
        await trainer.js.purge_stream(t.stream(BATCHES), subject=t.subject(BATCHES, 0), seq=2)
        assert (await trainer.js.stream_info(t.stream(BATCHES))).state.messages == 0

        for rt in (producer, trainer, rollout, scorer, buffer):
            await rt.close()

    asyncio.run(scenario())
    assert violations(caplog) == []
    # The operator inspects the run with its own credential.
    shown = subprocess.run(
        [sys.executable, "-m", "ops.streams", "show", "--run", run, "--nats", secured.url],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, IDENTITY_ENV: str(secured.identity("admin"))},
    )
    assert "rollout: pending 0, in flight 0" in shown.stdout, shown.stderr


def test_roles_cannot_write_what_is_not_theirs(
    secured: Secured, caplog: pytest.LogCaptureFixture
) -> None:
    t, run = secured.topology, secured.topology.run
    caplog.set_level(logging.WARNING)

    async def refused(js: JetStreamContext, subject: str) -> None:
        """The server drops the message: no stream stores it, so no ack ever comes."""
        with pytest.raises(nats.errors.TimeoutError):
            await js.publish(subject, b"forged", timeout=1.0)

    async def scenario() -> dict[str, int]:
        admin = await connect(secured.url, "admin", identity=secured.identity("admin"))
        admin_js = admin.jetstream()
        await t.apply(admin_js)
        before = {
            c: await messages(admin_js, t, c) for c in (PROMPTS, TRAJECTORIES, WEIGHTS, BATCHES)
        }

        rollout = await connect(secured.url, "rollout", identity=secured.identity("rollout"))
        rollout_js = rollout.jetstream()
        assert (await Publisher(rollout_js, t).publish(TRAJECTORIES, trajectory(run, 99))).seq
        await refused(rollout_js, t.subject(WEIGHTS))
        await refused(rollout_js, t.subject(BATCHES, 0))
        reward_nc = await connect(secured.url, "reward", identity=secured.identity("reward"))
        await refused(reward_nc.jetstream(), t.subject(PROMPTS))

        after = {c: await messages(admin_js, t, c) for c in before}
        for nc in (rollout, reward_nc, admin):
            await nc.close()
        return {c.name: after[c] - before[c] for c in before}

    stored = asyncio.run(scenario())
    assert stored == {"prompts": 0, "trajectories": 1, "weights": 0, "batches": 0}
    assert sorted(violations(caplog)) == sorted(
        f'nats {role}: Error: nats: {VIOLATION} for publish to "{subject.lower()}"'
        for role, subject in (
            ("rollout", t.subject(WEIGHTS)),
            ("rollout", t.subject(BATCHES, 0)),
            ("reward", t.subject(PROMPTS)),
        )
    )


def test_identities_are_files_only_their_owner_reads_and_keys_the_server_knows(
    secured: Secured,
) -> None:
    """`ops.streams users` wrote public keys for the server and a seed per role, each mode 600."""
    users = (secured.identities / USERS_FILE).read_text()
    for role in roles(secured.topology):
        seed = secured.identity(role.name)
        assert seed.stat().st_mode & 0o777 == 0o600
        assert f'nkey: "{public_key(seed.read_bytes().strip())}"' in users
        assert seed.read_text().strip() not in users
    assert "password" not in users and not re.search(
        r"\bSU[A-Z2-7]{50,}", users
    )  # no seed, no password


def test_wrong_credentials_fail_at_once_with_one_line(secured: Secured, tmp_path: Path) -> None:
    """No identity, one the server does not know, or one others may read:
    refused at once in one line."""
    stranger = tmp_path / "stranger.nk"
    write_private(stranger, new_seed())
    shared = tmp_path / "shared.nk"
    shared.write_bytes(secured.identity("rollout").read_bytes())
    shared.chmod(0o644)

    async def scenario() -> None:
        for identity in (None, stranger):
            with pytest.raises(
                ConnectRefused, match="refused this client's credentials.*check the identity file"
            ):
                await asyncio.wait_for(connect(secured.url, "wrong", identity=identity), 10)
        with pytest.raises(ConnectRefused) as refused:
            await connect(secured.url, "shared", identity=shared)
        assert (
            str(refused.value)
            == f"identity file {shared}: mode 644 lets others read it; chmod 600 {shared}"
        )

    asyncio.run(scenario())
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "ops.streams",
            "show",
            "--run",
            secured.topology.run,
            "--nats",
            secured.url,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, IDENTITY_ENV: str(stranger)},
    )
    assert cli.returncode == 1
    assert (
        cli.stderr.strip()
        .splitlines()[-1]
        .startswith(f"ops.streams: cannot reach NATS: {secured.url}:")
    )
    assert "refused this client's credentials" in cli.stderr
    worker = subprocess.run(
        [
            sys.executable,
            "-m",
            "consumers.buffer",
            "--run",
            secured.topology.run,
            "--nats",
            secured.url,
            "--identity",
            str(stranger),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert worker.returncode == 1
    last = worker.stderr.strip().splitlines()[-1]
    assert (
        last.startswith(f"consumers.buffer: {secured.url}:")
        and "refused this client's credentials" in last
    )


@pytest.mark.skipif(
    shutil.which("openssl") is None, reason="needs the openssl command to make a test certificate"
)
def test_tls_options_pass_through_connect(tmp_path: Path, topology: Topology) -> None:
    """A TLS-only server, a self-signed certificate for a name that is not the address dialled."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=jetrl-test",
            "-addext",
            "subjectAltName=DNS:jetrl-test",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    tls = f'tls {{ cert_file: "{cert}", key_file: "{key}", timeout: 2 }}\n'

    async def scenario(server: EmbeddedNats) -> None:
        context = ssl.create_default_context(cafile=str(cert))
        nc = await connect(server.url, "tls-test", tls=context, tls_hostname="jetrl-test")
        js = nc.jetstream()
        await topology.apply(js)
        assert (
            await Publisher(js, topology).publish(TRAJECTORIES, trajectory(topology.run))
        ).seq == 1
        await nc.close()
        # Without the CA the handshake fails the same way on every try: raised, not retried.
        with pytest.raises(ConnectRefused, match="TLS failed"):
            await asyncio.wait_for(
                connect(
                    server.url, "no-ca", tls=ssl.create_default_context(), tls_hostname="jetrl-test"
                ),
                10,
            )

    with EmbeddedNats(tmp_path / "nats", extra_config=tls) as server:
        asyncio.run(scenario(server))
