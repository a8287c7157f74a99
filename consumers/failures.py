"""Why a fleet stopped: each failed worker's one-line reason, the root cause first.

A run whose workers fail together shows effects beside the cause: a bad `model.path` stops the
rollout and the trainer at startup, and the stages around them then fail or stall on their
absence. The supervisor gives up on whichever worker reaches its restart limit first, which is
the one that fails fastest, not the cause (issue 26: a reward worker's import error was shown,
the model path error only in rollout-0.log). So when it gives up, the job's stop message lists
every worker that is failing, ranked by `rank`:

    tier 3  downstream      (checked first) reasons that describe an effect of another
                            failure or of a missing peer: a reward function that cannot be
                            imported, no live worker of a role, a stall, a timeout, a lost
                            connection
    tier 0  configuration   the reason names the run's config, model or tokenizer
                            (`model.path '/x': no such directory`, a config error): nothing can
                            run until it is fixed
    tier 1  model stages    any other failure of the stages that load the model at startup
                            (rollout, trainer and its ranks, reference): the rest wait on them
    tier 2  other workers   the failure of any other worker (buffer, reward, ...)

Among equals, the worker that started failing first comes first (then by name). Everything here
is pure: the supervisor reads the logs and the clock (consumers/supervisor.py).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

MODEL_STAGES = ("rollout", "trainer", "reference")
"""Stages that load the model (or its tokenizer) when they start."""
CONFIG = re.compile(r"\b(model|config|tokenizer)\b", re.IGNORECASE)
"""A reason that names the run's configuration or model: the root of everything else."""
DOWNSTREAM = re.compile(
    r"cannot import|no module named|reward function|no live|stalled|timed out|"
    r"connection (closed|refused|lost)|no responders",
    re.IGNORECASE,
)
"""A reason that describes an effect: of another failure, or of a peer that is missing."""
LOG_RECORD = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d[,.]\d+ ")
"""A line the worker's logging wrote (`2026-12-04 15:31:37,235 rollout INFO ...`)."""
SEVERE = re.compile(r" (ERROR|CRITICAL) ")
"""A record at a level that can say why a worker ended."""
FLEET_MARK = "--- "
"""The line the supervisor writes in a worker's log before each start."""
TIERS = ("configuration", "model stage", "other worker", "downstream")


@dataclass(frozen=True)
class Failure:
    """A worker that is failing: its last failed exit and since when it has been failing."""

    worker: str
    """`<role>-<index>`, its log file's stem."""
    stage: str
    """The stage it runs (`trainer` for `trainer-rank1-0`)."""
    reason: str
    """One line: what it said last (`reason_line`), or how it ended."""
    since: float
    """When the first of its failed exits in a row came (monotonic seconds)."""
    how: str = ""
    """How it ended and how often, for the reader (`exited with 1, 3 times`)."""
    gave_up: bool = False
    """The supervisor gave up restarting it."""


def reason_line(log_tail: str) -> str:
    """A worker's one-line reason from the end of its log: the last line of its latest start that
    its logging did not write (a `sys.exit` message, a traceback's last line); else its last
    ERROR or CRITICAL record; else '' (the caller says how the process ended instead)."""
    lines = log_tail.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith(FLEET_MARK)]
    latest = [line.strip() for line in lines[starts[-1] + 1 if starts else 0 :] if line.strip()]
    plain = [line for line in latest if not LOG_RECORD.match(line)]
    errors = [line for line in latest if LOG_RECORD.match(line) and SEVERE.search(line)]
    return (plain or errors or [""])[-1]


def tier(failure: Failure) -> int:
    """0 configuration, 1 model stage, 2 other worker, 3 downstream (see the module's table)."""
    if DOWNSTREAM.search(failure.reason):
        return 3
    if CONFIG.search(failure.reason):
        return 0
    return 1 if failure.stage in MODEL_STAGES else 2


def rank(failures: Iterable[Failure]) -> list[Failure]:
    """Root cause first: by tier, then by when the worker started failing, then by name."""
    return sorted(failures, key=lambda f: (tier(f), f.since, f.worker))


def stop_message(failures: Iterable[Failure], logs: str = "") -> str:
    """The fleet's stop message: its first line the root cause (`worker: reason`), then every
    failing worker's line, ranked, with how it ended."""
    ranked = rank(failures)
    if not ranked:
        return "the fleet stopped, but no worker has failed"
    where = f" (logs in {logs})" if logs else ""
    lines = [f"{ranked[0].worker}: {ranked[0].reason}"]
    lines.append(f"failed workers, root cause first{where}:")
    for failure in ranked:
        end = ", given up on" if failure.gave_up else ""
        lines.append(
            f"  {failure.worker}: {failure.reason} [{TIERS[tier(failure)]}; {failure.how}{end}]"
        )
    return "\n".join(lines)
