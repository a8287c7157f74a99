"""The timeline of colocated phases a run records (`JETRL_PHASE_LOG`, `consumers.colocation`),
read back and checked: no phase starts while another holds the device."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_timeline(log: Path) -> list[dict[str, Any]]:
    """Each phase start and end, with the pid of the process (from its member key,
    `<host>_<pid>_<role>`)."""
    timeline = [json.loads(line) for line in log.read_text().splitlines()]
    for line in timeline:
        line["pid"] = int(str(line["holder"]).split("_")[-2])
    return timeline


def phase_intervals(
    timeline: list[dict[str, Any]], killed: dict[int, float]
) -> list[tuple[float, float, str]]:
    """(start, end, phase) of every turn; a turn whose process was killed ends at the kill."""
    open_turns: dict[int, tuple[float, str]] = {}
    intervals = []
    for line in sorted(timeline, key=lambda item: float(item["t"])):
        pid, t = int(line["pid"]), float(line["t"])
        if line["event"] == "start":
            assert pid not in open_turns, f"{pid} started a turn inside its own"
            open_turns[pid] = (t, str(line["phase"]))
        else:
            started, phase = open_turns.pop(pid)
            intervals.append((started, t, phase))
    for pid, (started, phase) in open_turns.items():
        assert pid in killed, f"process {pid}'s {phase} turn never ended and it was not killed"
        intervals.append((started, killed[pid], phase))
    return sorted(intervals)


def assert_exclusive(intervals: list[tuple[float, float, str]]) -> None:
    for before, after in zip(intervals, intervals[1:], strict=False):
        assert after[0] >= before[1], (
            f"{after[2]} started at {after[0]:.3f} while {before[2]} "
            f"held the device until {before[1]:.3f}"
        )
