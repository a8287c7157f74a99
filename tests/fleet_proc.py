"""A stand-in worker for the fleet tests, started by the fleet like any worker.

    python -m tests.fleet_proc --run R --nats URL --mode MODE [--marker DIR] [--say TEXT]
        [--after SECONDS]
MODE crash: exit 3 at once (after SECONDS, saying TEXT on stderr). done: exit 0 at once.
MODE drain: write DIR/<pid>.ready (holding its CUDA_VISIBLE_DEVICES); on SIGTERM take
    0.3 s to "drain", write DIR/<pid>.drained, exit 0.
MODE stubborn: write DIR/<pid>.ready, then ignore SIGTERM (the fleet must SIGKILL it).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run", required=True)
    parser.add_argument("--nats", required=True)
    parser.add_argument("--mode", choices=["crash", "done", "drain", "stubborn"], required=True)
    parser.add_argument("--marker", type=Path)
    parser.add_argument("--say", default="")
    parser.add_argument("--after", type=float, default=0.0)
    args = parser.parse_args()
    if args.mode in ("crash", "done"):
        time.sleep(args.after)
        if args.say:
            print(args.say, file=sys.stderr)
        sys.exit(3 if args.mode == "crash" else 0)
    stopping = False

    def on_term(*_: object) -> None:
        nonlocal stopping
        stopping = args.mode == "drain"

    signal.signal(signal.SIGTERM, on_term)
    ready = args.marker / f"{os.getpid()}.ready"
    ready.with_suffix(".tmp").write_text(os.environ.get("CUDA_VISIBLE_DEVICES", ""))
    ready.with_suffix(".tmp").replace(ready)  # the test never reads a half-written marker
    while not stopping:
        time.sleep(0.05)
    time.sleep(0.3)
    (args.marker / f"{os.getpid()}.drained").touch()


if __name__ == "__main__":
    main()
