"""One place for NATS connection options: reconnect forever, say so in the log."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import ssl
from collections.abc import Callable
from pathlib import Path

import nats.errors
from nats.aio.client import Client
from nats.js import JetStreamContext, api

from bus.identity import IdentityError, connect_options

log = logging.getLogger("jetrl.bus")

DEFAULT_URL = "nats://127.0.0.1:4222"


def worker_id(role: str) -> str:
    """host:pid:role — the `source` of every event this process writes."""
    return f"{socket.gethostname()}:{os.getpid()}:{role}"


class JetStream(JetStreamContext):
    """A JetStream context that keeps the connection it was made from and its API prefix.

    A worker's byte-bounded pulls are core NATS traffic (its own inbox, a request published
    with that inbox as reply) that nats-py's context offers no public way to send; with
    `client` and `api_prefix` public here, the worker needs only a context, as the other
    stages' code does.
    """

    def __init__(
        self,
        client: Client,
        prefix: str = api.DEFAULT_PREFIX,
        domain: str | None = None,
        **opts: object,
    ) -> None:
        super().__init__(client, prefix=prefix, domain=domain, **opts)  # type: ignore[arg-type]
        self.client = client
        self.api_prefix = prefix if domain is None else f"$JS.{domain}.API"


class NatsClient(Client):
    """nats-py's client, whose `jetstream()` contexts are `JetStream`s, and which tells
    `drop_listeners` when its connection drops."""

    def __init__(self) -> None:
        super().__init__()
        self.drop_listeners: set[Callable[[], None]] = set()
        """Called, without arguments, each time the connection drops (`connect` arranges it):
        an answer to a request sent before may never come, since its server may be gone."""

    def jetstream(self, **opts: object) -> JetStream:
        return JetStream(self, **opts)  # type: ignore[arg-type]


class ConnectRefused(ConnectionError):
    """The server turned this client away for a reason waiting cannot fix (credentials, TLS)."""


def _refusal(exc: Exception) -> str | None:
    """Why `exc`, met while first connecting, will recur on every try; None if it may pass."""
    if isinstance(exc, ssl.SSLError):
        return f"TLS failed ({exc}); check the CA, certificate and server name"
    text = str(exc).lower()
    if (
        isinstance(exc, nats.errors.AuthorizationError)
        or "authorization" in text
        or "authentication" in text
    ):
        return f"the server refused this client's credentials ({exc}); check the identity file"
    return None


async def connect(
    url: str | list[str], name: str, *, identity: str | Path | None = None, **tls: object
) -> NatsClient:
    """Connect with reconnect-forever; `tls` passes through (tls=ssl.SSLContext, ...).

    `identity` is an nkey seed or creds file readable by its owner only (`bus.identity`);
    by default `$JETRL_NATS_IDENTITY`'s, or none. An unusable one raises `ConnectRefused`.

    Until the first connection, a server that is not up yet is waited for (workers may start
    first), but refused credentials or a failed TLS handshake raise `ConnectRefused` at once:
    retrying them forever would leave a worker that logs a warning twice a second and never
    says it cannot work. Once connected, every error is logged and reconnected through.
    """
    servers = url.split(",") if isinstance(url, str) else url
    try:
        credentials = connect_options(identity)
    except IdentityError as exc:
        raise ConnectRefused(str(exc)) from None
    connected = False

    async def error_cb(exc: Exception) -> None:
        log.warning("nats %s: %s: %s", name, type(exc).__name__, exc)
        if not connected and (reason := _refusal(exc)):
            raise ConnectRefused(f"{','.join(servers)}: {reason}")

    async def disconnected_cb() -> None:
        if not nc.is_closed:
            log.warning("nats %s: disconnected, reconnecting", name)
        for listener in list(nc.drop_listeners):
            listener()

    async def reconnected_cb() -> None:
        log.info(
            "nats %s: reconnected to %s", name, nc.connected_url.netloc if nc.connected_url else "?"
        )

    nc = NatsClient()
    try:
        await nc.connect(
            servers=servers,
            name=name,
            max_reconnect_attempts=-1,
            # nats-py annotates int; the value is a sleep in seconds, and half a second works.
            reconnect_time_wait=0.5,  # type: ignore[arg-type]
            connect_timeout=5,
            allow_reconnect=True,
            error_cb=error_cb,
            disconnected_cb=disconnected_cb,
            reconnected_cb=reconnected_cb,
            **credentials,
            **tls,  # type: ignore[arg-type]
        )
    except ConnectRefused:
        # Stop the client's tasks; after a failed TLS handshake its close waits forever on a
        # transport that never finishes closing, so it gets a second.
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(nc.close(), 1.0)
        raise
    connected = True
    return nc
