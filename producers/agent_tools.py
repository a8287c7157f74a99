"""The built-in agent task's tool: a calculator for one binary operation on whole numbers.

Named `producers.agent_tools:calculator` in `agent.tools` (examples/agent_calc.yaml); its JSON
schema comes from the signature and the docstring (`engines.tools.load_tool`). It runs in the
episode's sandboxed tool process (`consumers.tool_runner`), so it stays light: no eval, only
`re`, and operands of at most 12 digits (a product of two such has at most 24: no CPU bomb).
"""

from __future__ import annotations

import re

_EXPRESSION = re.compile(r"(\d{1,12})([*+-])(\d{1,12})")


def calculator(expression: str) -> str:
    """Evaluate one operation on two whole numbers, such as 23*47.

    Args:
        expression: Two whole numbers joined by one of * + -, with no spaces (e.g. 23*47).
    """
    match = _EXPRESSION.fullmatch(expression)
    if match is None:
        raise ValueError(f"{expression!r:.40} is not NUMBER OP NUMBER with OP one of * + -")
    a, op, b = int(match[1]), match[2], int(match[3])
    return str(a * b if op == "*" else a + b if op == "+" else a - b)
