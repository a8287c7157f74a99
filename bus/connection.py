"""One place for NATS connection options: reconnect forever, say so in the log."""

from __future__ import annotations

import logging
import os
import socket

import nats
from nats.aio.client import Client

log = logging.getLogger("jetrl.bus")

DEFAULT_URL = "nats://127.0.0.1:4222"


def worker_id(role: str) -> str:
    """host:pid:role — the `source` of every event this process writes."""
    return f"{socket.gethostname()}:{os.getpid()}:{role}"


async def connect(url: str | list[str], name: str, **tls: object) -> Client:
    """Connect with reconnect-forever; `tls` passes through (tls=ssl.SSLContext, user/password, ...)."""

    async def error_cb(exc: Exception) -> None:
        log.warning("nats %s: %s: %s", name, type(exc).__name__, exc)

    async def disconnected_cb() -> None:
        if not nc.is_closed:
            log.warning("nats %s: disconnected, reconnecting", name)

    async def reconnected_cb() -> None:
        log.info("nats %s: reconnected to %s", name, nc.connected_url.netloc if nc.connected_url else "?")

    servers = url.split(",") if isinstance(url, str) else url
    nc = await nats.connect(
        servers=servers,
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        connect_timeout=5,
        allow_reconnect=True,
        error_cb=error_cb,
        disconnected_cb=disconnected_cb,
        reconnected_cb=reconnected_cb,
        **tls,  # type: ignore[arg-type]
    )
    return nc
