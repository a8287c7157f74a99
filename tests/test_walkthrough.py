"""docs/walkthrough.md names symbols an editor can jump to: each must exist, and the hops stay few.

Every `a.b.c` in backticks whose first part is one of the project's packages is resolved by
importing the longest module prefix and walking the rest as attributes; a renamed function or
a moved module fails here with the name the page still uses.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "walkthrough.md"
PACKAGES = ("bus", "consumers", "producers", "engines", "schemas", "ops")
SYMBOL = re.compile(r"`((?:{})(?:\.[A-Za-z_][A-Za-z0-9_]*)+)`".format("|".join(PACKAGES)))
HOP = re.compile(r"^\s*(\d+)\. `", re.M)


def resolve(dotted: str) -> object:
    """The object `dotted` names: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for name in parts[cut:]:
            target = getattr(target, name)  # AttributeError names what the page got wrong
        return target
    raise ModuleNotFoundError(dotted)


def symbols(text: str) -> list[str]:
    return sorted(set(SYMBOL.findall(text)))


def test_every_symbol_the_walkthrough_names_exists() -> None:
    names = symbols(PAGE.read_text())
    assert len(names) >= 15, names  # the page is made of such symbols
    missing = []
    for name in names:
        try:
            resolve(name)
        except (ImportError, AttributeError) as exc:
            missing.append(f"{name}: {exc}")
    assert not missing, "docs/walkthrough.md names symbols that do not exist:\n" + "\n".join(
        missing
    )


def test_the_walkthrough_takes_at_most_15_hops() -> None:
    hops = [int(n) for n in HOP.findall(PAGE.read_text())]
    assert hops == list(range(1, len(hops) + 1)), hops
    assert 10 <= len(hops) <= 15, len(hops)


def test_a_name_that_does_not_exist_is_caught() -> None:
    """The check itself: a misspelt method and a moved module are both reported."""
    text = "`consumers.rollout.Rollout.handel` and `consumers.rollout_replicas.Replicas`"
    failed = []
    for name in symbols(text):
        try:
            resolve(name)
        except (ImportError, AttributeError):
            failed.append(name)
    assert failed == ["consumers.rollout.Rollout.handel", "consumers.rollout_replicas.Replicas"]
