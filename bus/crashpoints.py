"""Named crash points: the moments the invariants depend on, where a test or `ops.chaos` kills.

Each point is declared once below and called where the moment is in the code:

    BUFFER_MID_STEP()          # after the first micro-batch of a step is stored

It costs one dict test unless the environment arms it:

    JETRL_CRASH_AT="buffer.mid_step@2,trainer.mid_checkpoint@1"

makes the process SIGKILL itself on the 2nd pass of `buffer.mid_step` (passes counted from
the process start), and on the 1st pass of `trainer.mid_checkpoint`. A name not declared
here is refused at start-up with the list of names: a typo must not silently never fire.

    JETRL_CRASH_RECORD=DIR

makes each point fire once per DIR instead of once per process: before dying, the process
creates `DIR/<name>` (exclusively) holding what it was doing, and a point whose file
exists is disarmed. A supervised worker restarted with the same environment then runs on,
and the record says which point each kill hit and when.

    JETRL_FAIL_AT="rollout.mid_weight_load@1"

makes the point raise `InjectedFailure` on that pass instead: an error the code there does
not expect, to check that it takes its process down rather than leaving it up and idle
(`bus.stage`).

(In the spirit of FoundationDB's fault injection: the code names its dangerous moments, and
the tests hit those moments exactly instead of killing at a random time.)
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

CRASH_AT = "JETRL_CRASH_AT"
CRASH_RECORD = "JETRL_CRASH_RECORD"
FAIL_AT = "JETRL_FAIL_AT"


class InjectedFailure(RuntimeError):
    """Raised at a point armed by JETRL_FAIL_AT."""


@dataclass(frozen=True)
class CrashPoint:
    """A moment an invariant depends on. Call it at that moment."""

    name: str
    """`<role>.<moment>`, the name the environment arms it by."""
    role: str
    """The fleet role of the process that passes it."""
    moment: str
    """What has happened and what has not yet, when the process dies here."""

    def __call__(self, note: str = "") -> None:
        """Die here if armed for this pass; `note` (what is being worked on) goes to the record."""
        if _armed and self.name in _armed:
            _pass(self, note)
        if _failing and self.name in _failing:
            _fail(self, note)


POINTS: dict[str, CrashPoint] = {}


def _declare(role: str, moment_name: str, moment: str) -> CrashPoint:
    point = CrashPoint(f"{role}.{moment_name}", role, moment)
    POINTS[point.name] = point
    return point


PRODUCER_MID_PUBLISH = _declare(
    "producer",
    "mid_publish",
    "a prompt is stored; the prompts after it in the same gate opening are not",
)
ROLLOUT_MID_GENERATION = _declare(
    "rollout",
    "mid_generation",
    "a batch of prompts is being generated; none of its trajectories is published",
)
ROLLOUT_STORED_NOT_ACKED = _declare(
    "rollout", "stored_not_acked", "a prompt's trajectories are all stored; the prompt is not acked"
)
ROLLOUT_BETWEEN_TURNS = _declare(
    "rollout",
    "between_turns",
    "an agent episode's turn is recorded (its KV state); its next model turn is not started",
)
ROLLOUT_MID_TOOL_CALL = _declare(
    "rollout",
    "mid_tool_call",
    "an agent episode's tool call is running in its tool process; its result is not recorded",
)
ROLLOUT_MID_WEIGHT_LOAD = _declare(
    "rollout",
    "mid_weight_load",
    "the gate is closed and the new weights are being loaded into the engine",
)
ROLLOUT_HOLDING_DEVICE = _declare(
    "rollout",
    "holding_device",
    "placement colocated: the rollout holds the node's device (its lease taken, its engine's "
    "memory taken again); nothing of its phase is generated",
)
REWARD_MID_SCORING = _declare(
    "reward",
    "mid_scoring",
    "a trajectory is being scored; its reward is not published, the trajectory not acked",
)
REFERENCE_MID_SCORING = _declare(
    "reference",
    "mid_scoring",
    "a sample is being scored by the reference model; nothing is published, its reward not acked",
)
REFERENCE_STORED_NOT_ACKED = _declare(
    "reference",
    "stored_not_acked",
    "a scored sample is stored; the reward it came from is not acked",
)
BUFFER_MID_STEP = _declare(
    "buffer",
    "mid_step",
    "the first micro-batch of a step is stored; the step's other micro-batches are not",
)
BUFFER_STEP_STORED = _declare(
    "buffer",
    "step_stored",
    "every micro-batch of a step is stored; none of the step's samples is acked",
)
TRAINER_HOLDING_DEVICE = _declare(
    "trainer",
    "holding_device",
    "placement colocated: the trainer holds the node's device (its lease taken); the step's "
    "batches are collected, none is trained on",
)
TRAINER_LENDING = _declare(
    "trainer",
    "lending",
    "lend: true: the step's batches are in; the lent rollout still holds its prompts, its "
    "samples in flight not yet paused, what it finished stored and acked",
)
TRAINER_MID_STEP = _declare(
    "trainer",
    "mid_step",
    "a step's micro-batches are collected and trained on; its metrics are not written",
)
TRAINER_METRICS_WRITTEN = _declare(
    "trainer",
    "metrics_written",
    "a step's metrics are in KV; its checkpoint (if one is due) is not written",
)
TRAINER_MID_CHECKPOINT = _declare(
    "trainer",
    "mid_checkpoint",
    "the checkpoint's temporary file is written; it has not replaced the last one",
)


def armed() -> frozenset[CrashPoint]:
    """The points armed in this process (for code that must reach a moment only when armed:
    the buffer awaits its first micro-batch's ack only then). Fixed at start-up."""
    return _armed_points


def parse(spec: str, variable: str = CRASH_AT) -> dict[str, int]:
    """`name@k,name@k` (k >= 1, default 1) -> {name: k}; ValueError in one line, naming
    `variable`, if bad."""
    armed: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, count = item.partition("@")
        if name not in POINTS:
            raise ValueError(
                f"{variable}: no crash point {name!r}; the points are {', '.join(POINTS)}"
            )
        if count and (not count.isdigit() or int(count) < 1):
            raise ValueError(
                f"{variable}: {item!r}: the pass after '@' must be a whole number >= 1"
            )
        armed[name] = int(count or 1)
    return armed


def arm(spec: str) -> str:
    """The value of JETRL_CRASH_AT for `spec`, checked (for callers building environments)."""
    parse(spec)
    return spec


def records(directory: Path) -> dict[str, dict[str, object]]:
    """The points that fired with `JETRL_CRASH_RECORD=directory`: name -> record."""
    found: dict[str, dict[str, object]] = {}
    if directory.is_dir():
        for path in directory.iterdir():
            if path.name in POINTS:
                try:
                    found[path.name] = json.loads(path.read_text() or "{}")
                except (
                    json.JSONDecodeError
                ):  # killed between create and write: it fired all the same
                    found[path.name] = {}
    return found


def _pass(point: CrashPoint, note: str) -> None:
    _passes[point.name] = _passes.get(point.name, 0) + 1
    if _passes[point.name] != _armed[point.name]:
        return
    record = os.environ.get(CRASH_RECORD)
    if record:
        path = Path(record) / point.name
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return  # it fired in an earlier process of this run: disarmed
        what = {
            "point": point.name,
            "pid": os.getpid(),
            "time": time.time(),
            "pass": _passes[point.name],
            "note": note,
        }
        os.write(fd, json.dumps(what).encode())
        os.fsync(fd)
        os.close(fd)
    print(
        f"crash point {point.name} (pass {_passes[point.name]}): SIGKILL",
        file=sys.stderr,
        flush=True,
    )
    os.kill(os.getpid(), signal.SIGKILL)


def _fail(point: CrashPoint, note: str) -> None:
    _fail_passes[point.name] = _fail_passes.get(point.name, 0) + 1
    if _fail_passes[point.name] == _failing[point.name]:
        raise InjectedFailure(
            f"{FAIL_AT} {point.name} (pass {_fail_passes[point.name]}){': ' + note if note else ''}"
        )


_armed: dict[str, int] = parse(os.environ.get(CRASH_AT, ""))
_armed_points = frozenset(POINTS[name] for name in _armed)
_passes: dict[str, int] = {}
_failing: dict[str, int] = parse(os.environ.get(FAIL_AT, ""), FAIL_AT)
_fail_passes: dict[str, int] = {}
