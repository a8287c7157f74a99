"""Run by tests/test_release.py in a child process (a lost race faults, killing the process,
which the parent reports by its exit signal): one thread releases and resumes an HF engine
over and over, as a colocated rollout's phases do, while the main thread loads versions into
it, as the rollout's weights watcher does from its own thread.

    python -m tests.release_race MODEL_DIR LOADS  -> prints {"version": v, "loaded": bool}
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import torch

from engines.hf_rollout import HFRolloutEngine

NAME = "model.layers.0.mlp.down_proj.weight"


def main() -> None:
    model_dir, loads = Path(sys.argv[1]), int(sys.argv[2])
    torch.set_num_threads(1)
    engine = HFRolloutEngine(model_dir)
    base = dict(engine.model.named_parameters())[NAME].detach().clone()
    stop = threading.Event()

    def phases() -> None:
        while not stop.is_set():
            engine.release_memory()
            engine.resume_memory()

    turns = threading.Thread(target=phases, name="phases")
    turns.start()
    try:
        for version in range(1, loads + 1):
            engine.load_state_dict({NAME: base * version}, version=version)
    finally:
        stop.set()
        turns.join()
    engine.resume_memory()
    held = dict(engine.model.named_parameters())[NAME]
    print(json.dumps({"version": engine.version, "loaded": torch.equal(held, base * loads)}))


if __name__ == "__main__":
    main()
