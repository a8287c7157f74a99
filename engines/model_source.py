"""Where a run's model lives: `model.path` as a local Hugging Face directory, or a hub id.

Every worker resolves the configured path itself (`resolve_model_path`), so the rollout
workers and the trainer ranks of a run may sit on different nodes, each with its own hub
cache: a local directory is used as it is; anything else is taken as a hub repository id
(``org/name``) and fetched with `huggingface_hub.snapshot_download` into the hub cache
(``HF_HUB_CACHE`` / ``HF_HOME``, the library's own settings), or found there when
``HF_HUB_OFFLINE=1``. The tokenizer, its chat template, generation, training and the weights
sent back to rollout all load from the directory it returns, so all of them see one snapshot
of the repository (`model.revision` pins it: a branch, tag or commit). A ``.gguf`` file is
converted once to a Hugging Face directory in a per-node cache (`engines.gguf`), and that
directory is what every worker loads.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

WEIGHT_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken", "*.py")
"""What a causal LM needs from its repository (config, weights, tokenizer, chat template,
remote code): not the .bin/.pt/.gguf/.onnx copies many repositories also hold."""

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
"""A hub repository id: ``name`` or ``org/name`` (letters, digits, ``.``, ``_``, ``-``)."""


class ModelNotFound(RuntimeError):
    """`model.path` is neither a local model directory nor a hub id that can be fetched here."""


def resolve_model_path(path: str | Path | None, revision: str | None = None) -> Path:
    """The local directory holding the model `path` names (see the module doc).

    A local directory must hold a ``config.json``; a ``.gguf`` file is converted (once). A hub
    id is fetched (or, offline, found in the cache) at `revision` (None: the default branch).
    Anything else is a one-line `ModelNotFound` that says what was tried.
    """
    if path is None or str(path) == "":
        raise ModelNotFound(
            "model.path is empty: name a local Hugging Face model directory or a hub id"
        )
    local = Path(path).expanduser()
    if local.suffix.lower() == ".gguf":
        return _gguf(local, revision)
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ModelNotFound(
                f"model.path {str(path)!r} is a directory without config.json: "
                "not a Hugging Face model"
            )
        if revision is not None:
            raise ModelNotFound(
                f"model.revision {revision!r} is set but model.path {str(path)!r} is a local "
                "directory"
            )
        return local.resolve()
    name = str(path)
    if local.is_absolute() or name.startswith((".", "~")) or not HUB_ID.match(name):
        raise ModelNotFound(f"model.path {name!r}: no such directory, and not a hub id (org/name)")
    return _snapshot(name, revision)


def _gguf(file: Path, revision: str | None) -> Path:
    """The converted directory of GGUF `file` (`engines.gguf.converted_dir`)."""
    from engines.gguf import GgufError, converted_dir

    if revision is not None:
        raise ModelNotFound(
            f"model.revision {revision!r} is set but model.path {str(file)!r} is a local GGUF file"
        )
    if not file.is_file():
        raise ModelNotFound(f"model.path {str(file)!r}: no such GGUF file")
    try:
        return converted_dir(file)
    except GgufError as exc:
        raise ModelNotFound(str(exc)) from None


def hub_cache() -> Path:
    """The hub cache as the environment names it now (huggingface_hub reads it once, at import):
    ``HF_HUB_CACHE``, else ``HF_HOME``/hub, else ~/.cache/huggingface/hub."""
    if cache := os.environ.get("HF_HUB_CACHE"):
        return Path(cache).expanduser()
    home = (
        os.environ.get("HF_HOME")
        or Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "huggingface"
    )
    return Path(home).expanduser() / "hub"


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) set truthy, as huggingface_hub reads it."""
    value = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return value.strip().upper() in ("1", "ON", "YES", "TRUE")


def _snapshot(repo_id: str, revision: str | None) -> Path:
    """`repo_id` at `revision` from the hub cache, downloading what is missing unless offline."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    at = f"{repo_id}@{revision}" if revision else repo_id
    where, offline = hub_cache(), hub_offline()
    try:
        folder = Path(
            snapshot_download(
                repo_id,
                revision=revision,
                cache_dir=where,
                local_files_only=offline,
                allow_patterns=list(WEIGHT_PATTERNS),
            )
        )
    except LocalEntryNotFoundError:
        if offline:
            raise ModelNotFound(
                f"model {at} is not in the hub cache {where} and HF_HUB_OFFLINE is set: "
                f"download it first (huggingface-cli download {repo_id}) or unset HF_HUB_OFFLINE"
            ) from None
        raise ModelNotFound(
            f"model {at}: the hub cannot be reached and the cache {where} does not hold it"
        ) from None
    except (RepositoryNotFoundError, RevisionNotFoundError, HFValidationError) as exc:
        raise ModelNotFound(
            f"model {at}: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}"
        ) from None
    if not (folder / "config.json").is_file():
        raise ModelNotFound(
            f"model {at}: the snapshot {folder} holds no config.json: not a Hugging Face model"
        )
    return folder
