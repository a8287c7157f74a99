"""What the run's drops say: counts by kind, reward failures by reason, and whether the reward
function fails so often that the run must stop.

    KV drop.<prompt id> (DropRecord, typed by the buffer / rollout) -> DropTally.add
        -> by kind ("dropped 184 (equal 0: 180, failed 4)"), failures by reason (first of each
           said once on the console), the drops since the last step (the stall diagnosis)
    every finished group (dropped: its failed samples; trained: none) -> FailureWindow
        -> failed_share_stop (pure): more than reward.max_failed_share of the samples of the
           last reward.failed_window_groups groups failed (or, before the window is full,
           will have whatever the rest do) -> RewardsFailing stops the run

Everything here is pure: the producer (`producers.gate`) and `ops.status` feed it what they
read. Counting by a typed kind, never by parsing the reason's words.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field

from schemas.kv_records import DropKind, DropRecord

SHORT = {
    DropKind.FAILED: "failed",
    DropKind.EQUAL: "equal",
    DropKind.ADVANTAGE: "advantage",
    DropKind.STALE: "stale",
    DropKind.INCOMPLETE: "incomplete",
    DropKind.REFUSED: "refused",
    DropKind.UNKNOWN: "other",
}
"""How the progress line names each kind."""
SHOWN_REASONS = 3
"""Failure reasons a one-line summary names (the commonest); the rest are counted."""


class RewardsFailing(Exception):
    """The reward function failed more than `reward.max_failed_share` of recent samples."""


@dataclass
class DropTally:
    """Drops counted by kind (equal ones by their shared reward), and the failed samples of
    dropped groups by reason; `recent`: the same since the last trained step."""

    kinds: Counter[DropKind] = field(default_factory=Counter)
    equal: Counter[float] = field(default_factory=Counter)
    failures: Counter[str] = field(default_factory=Counter)
    since_step: Counter[DropKind] = field(default_factory=Counter)
    """Drops recorded since the last step the producer saw trained."""
    recent_failures: Counter[str] = field(default_factory=Counter)
    """Failed samples by reason since the last step."""

    def add(self, record: DropRecord) -> list[str]:
        """Count one drop; the failure reasons it brings that were never seen before."""
        kind = record.typed
        self.kinds[kind] += 1
        self.since_step[kind] += 1
        if kind is DropKind.EQUAL and record.equal_reward is not None:
            self.equal[record.equal_reward] += 1
        new = [reason for reason in record.failures if reason not in self.failures]
        self.failures.update(record.failures)
        self.recent_failures.update(record.failures)
        return new

    def stepped(self) -> None:
        """A step was trained: what holds back the next one starts again from none."""
        self.since_step.clear()
        self.recent_failures.clear()

    @property
    def total(self) -> int:
        return sum(self.kinds.values())

    def breakdown(self) -> str:
        """`184 (equal 0: 180, failed 4)`; `0` with none."""
        if not self.total:
            return "0"
        parts = [f"equal {value:g}: {n}" for value, n in self.equal.most_common(2)]
        other_equal = self.kinds[DropKind.EQUAL] - sum(n for _, n in self.equal.most_common(2))
        if other_equal:
            parts.append(f"equal other: {other_equal}")
        parts += [
            f"{SHORT[kind]} {n}"
            for kind, n in self.kinds.most_common()
            if kind is not DropKind.EQUAL and n
        ]
        return f"{self.total} ({', '.join(parts)})"

    def as_json(self) -> dict[str, object]:
        """For summary.json: drops by kind, equal drops by reward, failed samples by reason."""
        return {
            "by_kind": {kind.value: n for kind, n in self.kinds.most_common()},
            "equal_by_reward": {f"{value:g}": n for value, n in self.equal.most_common()},
            "reward_failures": dict(self.failures.most_common()),
        }


def failure_counts(failures: Counter[str]) -> str:
    """`12 raised KeyError: 'expected', 1 timed out after 5s`: the commonest SHOWN_REASONS, then
    how many other reasons ("; " is left to the stall text, which separates its reasons by it)."""
    shown = ", ".join(f"{n} {reason}" for reason, n in failures.most_common(SHOWN_REASONS))
    more = len(failures) - SHOWN_REASONS
    return shown + (f" and {more} other reasons" if more > 0 else "")


def failures_line(failures: Counter[str]) -> str:
    """`reward failures: 12 raised KeyError: 'expected', 1 timed out after 5s`, or
    `reward failures: none`."""
    return f"reward failures: {failure_counts(failures) if failures else 'none'}"


@dataclass
class FailureWindow:
    """The last `groups` finished groups as (failed samples, samples), newest last."""

    groups: int
    seen: deque[tuple[int, int]] = field(default_factory=deque)

    def add(self, failed: int, samples: int) -> None:
        self.seen.append((failed, samples))
        while len(self.seen) > self.groups:
            self.seen.popleft()


def failed_share_stop(
    window: FailureWindow, max_share: float, failures: Counter[str]
) -> str | None:
    """Why the run must stop, or None: more than `max_share` of the window's samples failed.
    The words name the commonest failure reason among `failures`.

    Before the window is full it is judged as if every group still to come passed (each of the
    mean size so far): the stop is said as soon as it is certain, not when the window fills. A
    reward that fails everything on a real model on the CPU (SmolLM2, 2 groups a minute) was
    stopped after 13 minutes when the whole window had to fill; this says it at the 17th group
    of 32, with the same decision."""
    failed = sum(f for f, _ in window.seen)
    samples = sum(n for _, n in window.seen)
    if not samples:
        return None
    to_come = (window.groups - len(window.seen)) * samples / len(window.seen)
    if failed / (samples + to_come) <= max_share:
        return None
    reason = failures.most_common(1)[0][0] if failures else "no reason recorded"
    which = (
        f"the last {window.groups} groups"
        if len(window.seen) == window.groups
        else f"the first {len(window.seen)} groups, more than {max_share:g} of the "
        f"{window.groups}-group window whatever the rest do"
    )
    return (
        f"the reward function failed {failed} of the {samples} samples of {which} "
        f"(reward.max_failed_share {max_share:g}): {reason}"
    )
