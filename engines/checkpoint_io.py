"""Checkpoint plumbing the train engines share: seeding, RNG states as plain data, atomic saves."""

import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """Torch, numpy and Python RNG states as plain data (loadable with weights_only=True)."""
    # legacy=True (the default) returns the tuple form; numpy types the call as tuple | dict.
    state = cast(tuple[str, np.ndarray, int, int, float], np.random.get_state(legacy=True))
    kind, keys, pos, has_gauss, cached_gaussian = state
    return {
        "torch": torch.get_rng_state(),
        "numpy": {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "python": random.getstate(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np_state = state["numpy"]
    np.random.set_state(
        (
            np_state["kind"],
            np_state["keys"].numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    random.setstate(state["python"])


def atomic_save(
    state: dict[str, Any], path: Path, before_replace: Callable[[], None] | None = None
) -> None:
    """torch.save to a temporary sibling, fsync, then rename over `path`.

    A crash mid-write leaves the previous checkpoint intact: readers see the old file or
    the new one, never half of one. The temporary's name is fixed, so the half-written one
    a killed trainer leaves is overwritten by its successor's next save, not kept forever.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    if before_replace is not None:
        before_replace()
    os.replace(tmp, path)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)
