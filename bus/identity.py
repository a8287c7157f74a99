"""A client's NATS identity: an nkey seed (or a creds file) in a file only its owner can read.

Why files: a password in `--nats nats://role:pw@host` is in the worker's command line, which
`ps` shows every local user and `/proc/<pid>/cmdline` shows any code of the same user; an
environment variable is in `/proc/<pid>/environ`. A worker is given a *path*
(`--identity PATH`, or `$JETRL_NATS_IDENTITY`), and nats-py signs the server's nonce with the
seed it reads there (`nkeys_seed`), or with a creds file's (`user_credentials`). The server
keeps only the public key (`nkey: U...` in its users block), which is no secret.

A file that group or others may read is refused with one line: whoever could read it could
be that role.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import TypedDict

import nkeys

IDENTITY_ENV = "JETRL_NATS_IDENTITY"
"""Path of this process's identity file, where no `--identity` is given."""
SEED_SUFFIX = ".nk"
CREDS_SUFFIX = ".creds"


class IdentityError(ValueError):
    """An identity file that cannot be used; the message is one line."""


def new_seed() -> bytes:
    """A fresh random user nkey seed (`SU...`)."""
    return bytes(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))


def public_key(seed: bytes) -> str:
    """The user's public key (`U...`), which the server's config names."""
    key = nkeys.from_seed(bytearray(seed))
    try:
        return bytes(key.public_key).decode()
    finally:
        key.wipe()


def write_private(path: Path, data: bytes) -> None:
    """Write `data` to `path`, readable and writable by its owner only from the first byte on."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT
        os.write(fd, data)
    finally:
        os.close(fd)


def identity_path(role: str, directory: Path) -> Path:
    """Where `role`'s seed lives in an identities directory (`ops.streams users --out DIR`)."""
    return Path(directory) / f"{role}{SEED_SUFFIX}"


class ConnectOptions(TypedDict, total=False):
    """The keyword arguments of nats-py's `connect` that carry an identity (at most one)."""

    user_credentials: str
    nkeys_seed: str


def connect_options(path: str | Path | None) -> ConnectOptions:
    """nats-py `connect` options for the identity at `path` (`$JETRL_NATS_IDENTITY` if None;
    none if unset)."""
    chosen = path if path is not None else os.environ.get(IDENTITY_ENV) or None
    if chosen is None:
        return {}
    file = Path(chosen)
    try:
        info = file.stat()
    except OSError as exc:
        raise IdentityError(f"identity file {file}: {exc.strerror}") from None
    if not stat.S_ISREG(info.st_mode):
        raise IdentityError(f"identity file {file}: not a regular file")
    if info.st_mode & 0o077:
        raise IdentityError(
            f"identity file {file}: mode {stat.S_IMODE(info.st_mode):o} lets others read it; "
            f"chmod 600 {file}"
        )
    if info.st_uid != os.geteuid():
        raise IdentityError(
            f"identity file {file}: owned by uid {info.st_uid}, "
            f"not by this process's {os.geteuid()}"
        )
    if file.suffix == CREDS_SUFFIX:
        return {"user_credentials": str(file)}
    return {"nkeys_seed": str(file)}
