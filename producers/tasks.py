"""Built-in generated tasks: seeded prompt records, their vocabulary and their rewards.

Each task is a rule over a short string of digits that a tiny random-init model can learn
by RL alone in minutes on a CPU (see `engines.tiny`):

- ``reverse``: prompt ``"r314="`` -> answer ``"413"``
- ``copy``:    prompt ``"c314="`` -> answer ``"314"``

Every symbol is one character and one token (`engines.tiny` builds a character-level
tokenizer), and text carries no spaces.

The reward is partial credit: the fraction of positions that hold the right digit, over
the longer of the answer and the response, so that a random model starts near 0.05, every
extra correct digit is rewarded, and rambling past the answer costs credit (the model
learns to stop with ``<eos>``).

This module must stay light (no torch): the producer imports it to make prompts and the
reward workers import it by name (``producers.tasks:score_<name>``) in a process pool.
"""

from collections.abc import Callable, Iterator
import random
from typing import Any

# One special token, which also pads (as in Qwen). Any other special token (<pad>, <bos>,
# <unk>) would be a symbol the policy can emit that `decode(skip_special_tokens=True)`
# hides: RL finds that loophole and pads answers with it instead of learning to stop.
SPECIAL_TOKENS: tuple[str, ...] = ("<eos>",)
DIGITS: tuple[str, ...] = tuple("0123456789")
# A one-letter rule name opens the prompt and "=" closes it, so one tokenizer serves every
# task and a mixed dataset stays possible.
TASK_WORDS: tuple[str, ...] = ("c", "r", "=")
# Token ids are positions in this tuple (`engines.tiny` builds the tokenizer from it).
VOCAB: tuple[str, ...] = SPECIAL_TOKENS + DIGITS + TASK_WORDS

# Answer lengths: short responses keep both the credit assignment and the decode loop cheap.
MIN_DIGITS = 3
MAX_DIGITS = 5
# Longest response worth sampling: the longest answer plus <eos>.
MAX_RESPONSE_TOKENS = MAX_DIGITS + 1

Rule = Callable[[str], str]
# task name -> (prompt letter, rule over the digit string)
RULES: dict[str, tuple[str, Rule]] = {
    "copy": ("c", lambda digits: digits),
    "reverse": ("r", lambda digits: digits[::-1]),
}


def task_record(name: str, index: int, *, seed: int = 0) -> dict[str, Any]:
    """The `index`-th prompt of task `name` for `seed`, without generating those before it.

    Each record gets its own RNG, seeded from a string (hashed by `random`, so stable
    across processes and Python runs), so a producer can resume at any cursor.
    """
    letter, rule = RULES[name]
    rng = random.Random(f"jetrl/{name}/{seed}/{index}")
    digits = "".join(rng.choice(DIGITS) for _ in range(rng.randint(MIN_DIGITS, MAX_DIGITS)))
    return {"prompt": f"{letter}{digits}=", "task": {"name": name, "target": rule(digits)}}


def iter_task(name: str, *, seed: int = 0, start: int = 0) -> Iterator[dict[str, Any]]:
    """Endless, deterministic stream of `task_record(name, i, seed=seed)` from `i = start`."""
    index = start
    while True:
        yield task_record(name, index, seed=seed)
        index += 1


def positional_score(response_text: str, target: str) -> float:
    """Fraction of symbols (characters) in place, over the longer sequence, in [0, 1].

    Whitespace is ignored (a decoder may put spaces between tokens). Dividing by the
    longer length (not the target's) makes extra symbols cost credit, and an empty
    response scores 0.
    """
    got, want = "".join(response_text.split()), target
    if not want:
        raise ValueError("empty target")
    hits = sum(g == w for g, w in zip(got, want))
    return hits / max(len(got), len(want))


def score_copy(response_text: str, task: dict[str, Any]) -> float:
    """Reward for the ``copy`` task (module-level, so a process pool can pickle it)."""
    return positional_score(response_text, task["target"])


def score_reverse(response_text: str, task: dict[str, Any]) -> float:
    """Reward for the ``reverse`` task (module-level, so a process pool can pickle it)."""
    return positional_score(response_text, task["target"])
