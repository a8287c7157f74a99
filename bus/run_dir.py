"""Where a local run's server is, written into its run directory so the operator's tools need
only the directory: `python -m ops.status --out runs/demo-...`.

The local job (`producers.prompts` without `--nats`) starts its own nats-server on a free
port and admits only the run's per-role identities (`identities/<role>.nk`); neither the port
nor the identity can be guessed from the run id. While its server runs, the job keeps

    <run dir>/server.json   {"run": id, "url": "nats://127.0.0.1:<port>",
                             "identity": "identities/admin.nk"}  (the operator's seed, relative)

and removes it when the server stops. `read_server` turns the directory into (run, url,
identity) or one line saying why it cannot.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SERVER_FILE = "server.json"


class RunDirError(ValueError):
    """The directory names no live local run; the message is one line."""


@dataclass(frozen=True)
class RunServer:
    run: str
    url: str
    identity: Path | None
    """The operator's (admin) seed file, absolute; None if the run has no identities."""


def write_server(out: Path, run: str, url: str, identity: Path | None) -> Path:
    """Record where run `run`'s server listens and the admin identity (relative to `out`)."""
    out.mkdir(parents=True, exist_ok=True)
    relative = None if identity is None else str(identity.resolve().relative_to(out.resolve()))
    path = out / SERVER_FILE
    path.write_text(json.dumps({"run": run, "url": url, "identity": relative}) + "\n")
    return path


def read_server(out: Path) -> RunServer:
    """The run, server URL and admin identity `out` records; RunDirError if none."""
    if not out.is_dir():
        raise RunDirError(f"{out}: no such run directory")
    path = out / SERVER_FILE
    if not path.exists():
        raise RunDirError(
            f"{out} has no {SERVER_FILE}: its local job is not running (the job writes it while "
            "its server runs; for a cluster's run give --run R --nats URL)"
        )
    try:
        data = json.loads(path.read_text())
        identity = data.get("identity")
        return RunServer(
            str(data["run"]), str(data["url"]), None if identity is None else out / identity
        )
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise RunDirError(f"{path}: not a server record ({exc!r})") from None
