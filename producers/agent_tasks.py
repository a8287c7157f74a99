"""The built-in multi-turn task `calc`: multiply two numbers, which only the calculator can do.

A prompt is one user message, ``57*83`` (both operands in 32..99, so every product has four
digits), and the agent has the calculator tool (`producers.agent_tools`). The episode that
scores 1.0 is two model turns (`engines.tiny_chat` makes the call 10 tokens):

    user        57*83
    assistant   <tool_call>{"name": "calculator", "arguments": {"expression": "57*83"}}</tool_call>
    user        <tool_response>\\n4731\\n</tool_response>      (the tool's turn, not trained)
    assistant   4731

Why this is learnable by the tiny random-init model of `engines.tiny_chat` on a CPU: each
turn is a COPY at a fixed distance, which `producers.tasks` explains one attention head with
RoPE can learn -- the expression from the user turn (fixed length, so a fixed offset) between
two fixed pieces, then the result from the tool's turn (always four digits, so a fixed offset
again). The multiplication itself the model never learns: it cannot, and an answer without a
well-formed call earns nothing.

The reward (`score_calc`), dense, each part a fraction in place, 1.0 only for the whole
episode right:

    0.1 x the call's shape: the model's FIRST turn against the ideal call, token by token
          (each added piece of `engines.tiny_chat` counts as one, as the model emits it), as a
          PREFIX: a fixed piece in place earns 1 and the first one out of place ends the
          credit; the expression is the run of digits and operators after
          ``{"name": ...: "``, of any length, and its places earn 1 whatever the character;
          over the call's 9 tokens (over the turn's length once the whole call is there, so
          text past it, or a longer expression, costs)
    0.6 x the expression: that run against the asked expression, character by character in
          place, over the longer of the two (0 when the call's head is not in place)
    0.3 x the answer's copy of the tool's result, after ANY well-formed call: the text after
          the LAST ``</tool_response>``, digit by digit against what the calculator answered
          the first turn's one call (recomputed, `tool_result`: a tool response the model
          writes itself earns nothing), in place, over the longer; 0 when the calculator
          refused the call, or the turn is not exactly one well-formed call

1.0 still means solved: the shape and the expression whole make the call the ideal one, whose
result is the product. The copy is credited after any call because the copy skill is the same
whatever the expression, so it is learnable from every episode, not only from the rare one
that called the asked expression; and it is right or wrong by the model's copy, not by chance
(the product, which the model cannot compute, earns nothing as the answer of another call).

The run starts from a format warm start (`model.warm_start`, `demonstration`: calls of random
expressions, so the call's shape is there and the answer is the tool's result copied, but
which expression to call is RL's to learn). Measured (lr 2e-3, 20 warmup steps, 2 loaded CPU
cores, docs/agents.md): the answer's exact copy of the tool's result 0.47 -> 0.77 of sampled
episodes (every sampled right call answered right at steps 80-108), reward 0.51 -> 0.76 in
109 steps, but solved only 3%: the first operand's first digit and the second operand's last
digit stayed at chance, and a group wrong at the same places scores equal (0.76) whatever its
wrong digits, so it is dropped (238 groups by step 109).

Measured, each earlier design (2 CPU cores, 8 samples x 16 prompts a step, lr 1e-3 or 2e-3);
none of the first four formed a whole call:
- Crediting the call by its longest common subsequence with the ideal (a token anywhere after
  the right ones counts), and a guess without a call as an answer, gave the random policy the
  most signal (reward 0.06 at the start), but it settled at 0.20 by step 100 on "digit soup"
  (``5367*73s*8``: digits and stars sharing a few with the expression and the product, in
  order) and formed no call in 200 steps.
- Crediting each token in place (the call) and a guess without a call as an answer: the policy
  learned ``<tool_call>`` as its first token by step 50, then collapsed onto
  ``<tool_call>444444444`` (the digit that guesses the products' digits best, everywhere) by
  step 120: the next fixed piece was never found.
- In place with the answer counted only after a call: the tiny model cannot yet tell one
  position from another, so a piece rewarded at one place (``"}}`` at the 8th) was learned at
  every place: ``<tool_call>"}}"}}"}}...`` by step 140, every group's reward equal (0.1), no
  gradient left. As a prefix, a piece earns only in its place after the right ones, so there
  is nothing to spam (measured: ``<tool_call>`` learned by step 60, the next piece by step 140,
  no spam); the half credit for a wrong expression character lets the shape of the call form
  before the copy of the expression is learned (a well-formed call with a wrong expression
  still runs the tool, which says why it refused it), and an entropy bonus
  (`algorithm.entropy_coef` 0.01) keeps the policy exploring the places it has not learned
  yet (without it, the one piece learned spread to every place, as above: ``<tool_call>``
  x 10 by step 55).
- The expression as exactly 5 places, the piece after it due at the 8th token: the policy
  learned the tag by step 50, the head by 110, five expression characters by 230 (reward
  0.015 -> 0.28), then filled the 8th place and on with expression characters too, and in
  the next 170 steps never wrote ``"}}`` after them (0 of 314 turns sampled): tool use 0.008
  at step 400 (18.6 minutes). With the expression a run of any length, ``"}}`` may come after
  any of them, and a turn of 16 tokens leaves it 6 more places to be found in.
- 0.5 x the call (the expression's places in it earning 1 for the right character, 0.5 for
  another) + 0.5 x the answer after any well-formed call, from a format warm start (lr 5e-4,
  no entropy bonus): the format held for 58 steps, the asked expression was never copied
  (reward 0.46 -> 0.47). One right expression character was worth 0.028, and the answer's
  digits, credited after a call of ANY expression, matched the product by chance (about one
  in ten a digit, 0.125 each): that noise was ten times the expression's signal in a group's
  rewards. Hence the weights above and, next, the answer only after the asked expression's
  call.
- As above, but 0.3 x the answer (digits against the product) only after a well-formed call
  of exactly the asked expression, from the warm start (lr 2e-3, 20 warmup steps): reward
  0.28 -> 0.66 in 206 steps, calls of exactly the asked expression 0% -> 27%, but solved only
  ~1%: the first operand's first digit lagged (a prompt's 8 samples often wrote the same
  wrong one: equal rewards, the group dropped), and the answer, paid for only after a right
  call, which was rare for 100 steps, drifted from copying the tool's result (0 of 105 right
  calls answered right at steps 180-205). Hence the copy credited after any call.

The first turn and the answer are read from the episode's response text as the rollout
decodes it (only ``<|im_end|>`` is special, so ``{turn 1}\n<|im_start|>user\n<tool_response>
...</tool_response>\n<|im_start|>assistant\n{answer}``): `score_calc` needs no tokenizer. An
episode whose render stopped extending its tokens stores its last sample only
(`consumers.episodes`); its text then lacks the first turn and scores as a turn without a call
(rare: the model must spell an added piece character by character).

Light like `producers.tasks` (no torch): the producer imports it to make prompts and the
reward workers import `producers.agent_tasks:score_calc` by name.
"""

from __future__ import annotations

import itertools
import random
import re
from typing import Any

from engines.tiny_chat import ADDED_TOKENS, CALL_HEAD, CALL_TAIL, IM_START
from engines.tools import parse_tool_calls
from producers.agent_tools import calculator

TASKS: tuple[str, ...] = ("calc",)
OPERANDS = range(32, 100)
"""Two-digit operands whose products all have four digits (32 * 32 = 1024)."""
EXPRESSION_CHARS = frozenset("0123456789*+-")
WRONG_CHAR = 0.5
"""The call's credit for an expression character in the expression's place, but the wrong one
(a well-formed call with a wrong expression still runs the tool)."""
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
_PIECES = re.compile("|".join(re.escape(t) for t in sorted(ADDED_TOKENS, key=len, reverse=True)))


def task_record(name: str, index: int, *, seed: int = 0) -> dict[str, Any]:
    """The `index`-th prompt of task `name` for `seed` (own RNG per record, as
    `producers.tasks.task_record`): ``{"prompt": None, "messages": [{"role": "user",
    "content": "57*83"}], "task": {"name": "calc", "expression": "57*83", "answer": "4731"}}``."""
    if name not in TASKS:
        raise ValueError(f"unknown agent task {name!r}; choose from {list(TASKS)}")
    rng = random.Random(f"jetrl/{name}/{seed}/{index}")
    a, b = rng.choice(OPERANDS), rng.choice(OPERANDS)
    expression = f"{a}*{b}"
    return {
        "prompt": None,
        "messages": [{"role": "user", "content": expression}],
        "task": {"name": name, "expression": expression, "answer": str(a * b)},
    }


def demonstration(index: int, *, seed: int = 0) -> list[dict[str, Any]]:
    """The `index`-th warm-start demonstration (`model.warm_start`, `engines.warm_start`): a calc
    prompt, a calculator call of ANOTHER random expression, its result, and that result copied
    as the answer. It teaches the tool's format and that the answer is the tool's result, never
    the task: which expression to call (the user's) is left to RL. Records of their own RNG,
    apart from the prompts' (`task_record`)."""
    rng = random.Random(f"jetrl/calc-demonstration/{seed}/{index}")
    asked = f"{rng.choice(OPERANDS)}*{rng.choice(OPERANDS)}"
    called = f"{rng.choice(OPERANDS)}*{rng.choice(OPERANDS)}"
    result = str(calculator(called))
    call = {"function": {"name": "calculator", "arguments": {"expression": called}}}
    return [
        {"role": "user", "content": asked},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "calculator", "content": result},
        {"role": "assistant", "content": result},
    ]


def ideal_call(expression: str) -> str:
    """The first turn that earns the call's half of the reward in full."""
    return f"<tool_call>{CALL_HEAD}{expression}{CALL_TAIL}</tool_call>"


def units(text: str) -> list[str]:
    """`text` as the tokens the chat tokenizer makes of it: each added piece one, each other
    character one."""
    out: list[str] = []
    at = 0
    for match in _PIECES.finditer(text):
        out += list(text[at : match.start()])
        out.append(match[0])
        at = match.end()
    return out + list(text[at:])


def in_place(got: list[str], want: list[str]) -> float:
    """The fraction of positions where `got` holds `want`'s item, over the longer of the two."""
    if not got and not want:
        return 1.0
    hits = sum(g == w for g, w in zip(got, want, strict=False))
    return hits / max(len(got), len(want))


def call_credit(got: list[str], want: list[str], slots: range, wrong: float = WRONG_CHAR) -> float:
    """`got` against the ideal call `want` as a prefix, whose expression (`want`'s `slots`) may
    be a run of any length in `got`: each fixed unit in place earns 1 and the first one out of
    place ends the credit; in the run of expression characters (`EXPRESSION_CHARS`) after
    them, each of the expression's places earns 1 for the right character, `wrong` for
    another (characters past the expression's length earn nothing). Over len(want), or over
    the longer of the two once the whole call is there (text past it, or a longer run, costs).
    With `wrong` 1 it is the call's shape alone, whatever the expression.
    """
    credit, at = 0.0, 0
    for w in want[: slots.start]:
        if at >= len(got) or got[at] != w:
            return credit / len(want)
        credit, at = credit + 1.0, at + 1
    run = list(itertools.takewhile(EXPRESSION_CHARS.__contains__, got[at:]))
    expression = want[slots.start : slots.stop]
    credit += sum(1.0 if g == w else wrong for g, w in zip(run, expression, strict=False))
    at += len(run)
    for w in want[slots.stop :]:
        if at >= len(got) or got[at] != w:
            return credit / len(want)
        credit, at = credit + 1.0, at + 1
    return credit / max(len(got), len(want))


def called_expression(got: list[str], want: list[str], slots: range) -> list[str] | None:
    """The run of expression characters `got` has in the expression's place (after the ideal
    call's units before `slots`, all in place), or None when those units are not all there."""
    if got[: slots.start] != want[: slots.start]:
        return None
    return list(itertools.takewhile(EXPRESSION_CHARS.__contains__, got[slots.start :]))


def first_turn(response_text: str) -> str:
    """The model's first turn: the text before the first tool response (and the user-turn
    header the template put before it), or the whole text when no tool answered."""
    head, found, _ = response_text.partition(RESPONSE_OPEN)
    return head.removesuffix(f"\n{IM_START}user\n") if found else response_text


def answer(response_text: str) -> str:
    """The text after the last tool response (the assistant-turn header the template put
    before it removed), whitespace removed; '' when no tool answered."""
    _, found, tail = response_text.rpartition(RESPONSE_CLOSE)
    return "".join(tail.removeprefix(f"\n{IM_START}assistant\n").split()) if found else ""


def called(turn: str) -> bool:
    """Whether a model turn is well-formed tool calls and nothing malformed."""
    parsed = parse_tool_calls(turn)
    return bool(parsed.calls) and not parsed.errors


SHAPE, EXPRESSION, ANSWER = 0.1, 0.6, 0.3
"""`score_calc`'s weights: the call's shape, the asked expression in it, the copied answer."""


def tool_result(turn: str) -> str | None:
    """What the calculator answered the turn's call, recomputed (the tool is pure), or None when
    the turn is not exactly one well-formed calculator call, or the calculator refused it.
    Recomputed rather than read from the tool's turn in the text: the model could write a
    ``<tool_response>`` of its own in its answer turn (`answer` reads after the LAST one) and
    pay itself for copying it."""
    parsed = parse_tool_calls(turn)
    if len(parsed.calls) != 1 or parsed.errors:
        return None
    [call] = parsed.calls
    expression = call.arguments.get("expression")
    if call.name != "calculator" or not isinstance(expression, str):
        return None
    try:
        return calculator(expression)
    except ValueError:
        return None


def score_calc(response_text: str, task: dict[str, Any]) -> float:
    """SHAPE x the call's shape + EXPRESSION x the asked expression in it + ANSWER x the answer's
    copy of the tool's result, each a fraction in place (see the module doc), the copy after
    ANY well-formed call; in [0, 1], 1.0 only for the whole episode right (the shape and the
    expression whole make the call exactly the ideal one, so the copied result is the
    product). Module-level, so a process pool can pickle it."""
    turn = units(first_turn(response_text))
    want = units(ideal_call(task["expression"]))
    start = want.index(CALL_HEAD) + 1
    slots = range(start, start + len(task["expression"]))
    shape = call_credit(turn, want, slots, wrong=1.0)
    run = called_expression(turn, want, slots)
    expression = 0.0 if run is None else in_place(run, list(task["expression"]))
    result = tool_result("".join(turn))
    copy = 0.0 if result is None else in_place(list(answer(response_text)), list(result))
    return SHAPE * shape + EXPRESSION * expression + ANSWER * copy


_NUMBER = re.compile(r"\d+")


def score_calc_text(response_text: str, task: dict[str, Any]) -> float:
    """`calc` for a real chat model (`examples/agent_smollm2.yaml`), whatever its template:
    0.5 for a well-formed calculator call with the task's expression anywhere in the episode,
    plus 0.5 x the last number of the text against the product, digit by digit in place (the
    calculator's result, which the text holds after a call, is not counted as an answer).
    (`score_calc` reads the tiny chat model's own turn layout; a real template lays the tool's
    turn out its own way.)"""
    parsed = parse_tool_calls(response_text)
    call = any(
        c.name == "calculator" and c.arguments.get("expression") == task["expression"]
        for c in parsed.calls
    )
    text = response_text
    if call:  # the calculator's own answer in the text is not the model's: take it out
        after = text.find("</tool_call>")
        at = text.find(task["answer"], after)
        if after >= 0 and at >= 0:
            text = text[:at] + text[at + len(task["answer"]) :]
    numbers = _NUMBER.findall(text)
    last = numbers[-1] if numbers else ""
    return 0.5 * call + 0.5 * in_place(list(last), list(task["answer"]))
