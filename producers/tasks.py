"""Built-in generated tasks: seeded prompt records, their vocabulary and their reward.

A prompt is a one-letter rule followed by four digits and ``=``; the answer is the rule
applied to the digits:

- ``copy``       (``c``): ``"c3149="`` -> ``"3149"``
- ``increment``  (``i``): ``"i3149="`` -> ``"4250"`` (each digit + 1, mod 10)
- ``reverse``    (``r``): ``"r3149="`` -> ``"9413"`` (harder: see below)

Task ``digits`` (the default) mixes ``copy`` and ``increment`` at random, so the policy
must read the rule letter: it learns two rules, not one string map.

Why this is learnable by RL alone, from random init, in seconds to minutes on a CPU: the
vocabulary is 15 symbols, answers are 4 tokens + ``<eos>``, and with a fixed length each
answer digit sits at a fixed distance from its source digit, which one attention head
with RoPE can find; the reward gives partial credit per digit. Measured with the 2-layer,
hidden-64 Qwen2 of `engines.tiny`, GRPO, 16 prompts x 8 samples per step, lr 3e-4: mean
reward ~0.06 at start, flat for ~200 steps, then >= 0.8 by step 410-520 (4 seeds) and
1.0 by ~800; weights 1, 2 or 4 steps stale change none of that. ``reverse`` needs an
offset that changes along the answer (an induction-style circuit): it plateaus near 0.67,
then jumps to 1.0 around step 2,800 -- for long runs, not for the demo.

Every symbol is one character and one token, and text carries no spaces. The reward is
partial credit: the fraction of positions that hold the right digit, over the longer of
the answer and the response, so rambling past the answer costs credit and the policy
learns to stop with ``<eos>``.

This module must stay light (no torch): the producer imports it to make prompts and the
reward workers import ``producers.tasks:score_<name>`` by name in a process pool.
"""

import random
from collections.abc import Callable
from typing import Any

# One special token, which also pads (as in Qwen). Any other special token (<pad>, <bos>,
# <unk>) would be a symbol the policy can emit that `decode(skip_special_tokens=True)`
# hides: RL finds that loophole and pads answers with it instead of learning to stop.
SPECIAL_TOKENS: tuple[str, ...] = ("<eos>",)
DIGITS: tuple[str, ...] = tuple("0123456789")

Rule = Callable[[str], str]
# rule name -> (the letter that opens its prompts, the rule over the digit string)
RULES: dict[str, tuple[str, Rule]] = {
    "copy": ("c", lambda digits: digits),
    "increment": ("i", lambda digits: "".join(DIGITS[(int(d) + 1) % 10] for d in digits)),
    "reverse": ("r", lambda digits: digits[::-1]),
}
# task name -> the rules its prompts draw from
TASKS: dict[str, tuple[str, ...]] = {
    "digits": ("copy", "increment"),
    **{rule: (rule,) for rule in RULES},
}
DEFAULT_TASK = "digits"

# "=" closes every prompt. Token ids are positions in VOCAB (`engines.tiny` builds the
# tokenizer from it): changing RULES changes ids, so rebuild the tiny model after it.
LETTERS: tuple[str, ...] = tuple(letter for letter, _ in RULES.values())
VOCAB: tuple[str, ...] = SPECIAL_TOKENS + DIGITS + LETTERS + ("=",)

# A fixed length keeps every answer digit at a fixed offset from its source (see above).
NUM_DIGITS = 4
# Sampling budget: the answer, <eos>, and one spare token, so that a policy which never
# stops is capped at 4/6 < 0.8 and has to learn <eos> to pass.
MAX_RESPONSE_TOKENS = NUM_DIGITS + 2


def task_record(name: str, index: int, *, seed: int = 0) -> dict[str, Any]:
    """The `index`-th prompt of task `name` for `seed`, without generating those before it.

    Returns ``{"prompt": "i3149=", "task": {"name": "digits", "rule": "increment",
    "target": "4250"}}``. Each record has its own RNG seeded from a string (hashed by
    `random` with SHA-512, so stable across processes and Python runs), so a producer can
    resume at any cursor.
    """
    rng = random.Random(f"jetrl/{name}/{seed}/{index}")
    rule = rng.choice(TASKS[name])
    letter, apply = RULES[rule]
    digits = "".join(rng.choice(DIGITS) for _ in range(NUM_DIGITS))
    return {
        "prompt": f"{letter}{digits}=",
        "task": {"name": name, "rule": rule, "target": apply(digits)},
    }


def score_digits(response_text: str, task: dict[str, Any]) -> float:
    """Fraction of answer symbols in place, over the longer of answer and response, in [0, 1].

    Whitespace is ignored (a decoder may put spaces between tokens). Dividing by the
    longer length (not the answer's) makes extra symbols cost credit; an empty response
    scores 0. Module-level, so a process pool can pickle it.
    """
    got, want = "".join(response_text.split()), task["target"]
    hits = sum(g == w for g, w in zip(got, want, strict=False))
    return hits / max(len(got), len(want))


# Every task has the same reward; these names let `producers.tasks:score_<name>` resolve
# for each task name.
score_copy = score_increment = score_reverse = score_digits
