"""The tool process: `python -m consumers.tool_child`, started by consumers/tool_runner.py,
one per agent episode.

It makes itself what the runner asked for (`consumers.sandbox_child.begin`: the worker's
import path, SIGKILL when the worker dies, the sandbox where one was chosen, rlimits), moves
into the episode's working directory, then serves calls until the runner closes the pipe:

    runner --init (+ workdir, caps), then {"op": "load", "spec"} or
           {"op": "call", "spec", "arguments"}--> stdin
    runner <-- {} (loaded), {"content": text} or {"error": one line, "fatal": over a cap} -- stdout

A tool is imported on its first call (`engines.tools.import_tool`, no transformers here: the
worker made the schemas). While it runs, the process's stdout and stderr (descriptors 1 and 2,
so C code's output too) go to an unlinked temporary file, not to the worker's log; printed
output is dropped, and more than `max_printed` bytes of it fails the call. A result over
`max_result` bytes (UTF-8) fails the call too, before it is framed: the reply never carries it.
"""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

from consumers.sandbox_child import begin, describe, frame, receive, renew_cpu_limit
from engines.tools import ToolError, import_tool, result_text

SANDBOX_WORKDIR = "/tmp/work"
"""The episode's working directory inside the sandbox: on its private tmpfs."""


def _child_main() -> None:
    started = begin()
    if started is None:
        return
    requests, replies, init = started
    workdir = init["workdir"] or SANDBOX_WORKDIR
    os.makedirs(workdir, mode=0o700, exist_ok=True)
    os.chdir(workdir)
    os.environ["HOME"] = workdir
    functions: dict[str, Callable[..., Any]] = {}
    server = os.getpid()
    while (request := receive(requests)) is not None:
        renew_cpu_limit(request["cpu_seconds"])
        reply = _call(request, functions, init["max_result"], init["max_printed"])
        if os.getpid() != server:  # a copy the tool forked, back from the call: it must not reply
            os._exit(0)
        replies.write(frame(reply))
        replies.flush()


def _call(
    request: dict[str, Any],
    functions: dict[str, Callable[..., Any]],
    max_result: int,
    max_printed: int,
) -> dict[str, Any]:
    """Import (once) and call the tool; its reply, checked against the caps."""
    spec = request["spec"]
    with tempfile.TemporaryFile() as printed:
        saved = _redirect_output(printed.fileno())
        try:
            if request["op"] == "load":
                functions[spec] = import_tool(spec)
                return {}
            value = functions[spec](**request["arguments"])
            text = result_text(value)
        except ToolError as exc:
            return {"error": str(exc)}
        except SystemExit as exc:
            return {"error": f"called sys.exit({exc.code!r})"}
        except BaseException as exc:  # the tool's failure is the call's result, whatever it is
            return {"error": f"raised {describe(exc)}"}
        finally:
            _restore_output(saved)
        size = os.fstat(printed.fileno()).st_size
    if size > max_printed:
        return {"error": f"printed {size} bytes, over the {max_printed}-byte cap", "fatal": True}
    encoded = len(text.encode(errors="replace"))
    if encoded > max_result:
        return {"error": f"returned {encoded} bytes, over the {max_result}-byte cap", "fatal": True}
    return {"content": text}


def _redirect_output(fd: int) -> int:
    """Descriptors 1 and 2 to `fd`; returns a copy of the old 2 (1 is a copy of it)."""
    saved = os.dup(2)
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    return saved


def _restore_output(saved: int) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a write the file-size limit refused; dropped anyway
            pass
    os.dup2(saved, 1)
    os.dup2(saved, 2)
    os.close(saved)


if __name__ == "__main__":
    _child_main()
