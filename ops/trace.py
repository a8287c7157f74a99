"""`python -m ops.trace PROMPT_ID_OR_TRACE_ID [--jaeger URL]`: one prompt's life, from Jaeger.

A prompt id (`<run>/<epoch>/<index>`) is looked up with Jaeger's search
(`GET /api/traces?service=jetrl-producer&operation=prompt&tags={"jetrl.prompt_id": ...}`),
a trace id (32 hex digits) fetched directly (`GET /api/traces/<id>`). The trace is printed
as a timeline, one span a line in tree order:

    offset from the prompt's start, duration, span (indented under its parent), the worker
    that ran it, the weight version it concerns, what it says (reward, tokens, drop reason)

Batch assembly and train steps serve many prompts, so they live in traces of their own and
*link* to the `outcome` spans of the samples they took. Jaeger cannot search by link, so each
batched sample's step (`jetrl.step` on its `outcome` span) is searched for in the buffer's
and trainers' services, and the spans that link into this trace are printed after it, with
what they started: the `publish weights` of the version the step produced.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

DEFAULT_JAEGER = "http://127.0.0.1:16686"
TRACE_ID = re.compile(r"[0-9a-f]{32}")
PRODUCER = "jetrl-producer"
LINKING = (("jetrl-buffer", "assemble batch"), ("jetrl-trainer", "train step"))
"""(service, span) of the spans that link to a sample's `outcome` span, searched by run and step."""
VERSION_TAGS = ("jetrl.weight_version", "jetrl.policy_version", "jetrl.admitted_version")
"""The first of these a span has is its version column: made, generated with, admitted at."""


class TraceError(Exception):
    """Jaeger cannot be asked, or has nothing; the message is one line for the operator."""


@dataclass(frozen=True)
class SpanView:
    """One span of Jaeger's JSON, with its process resolved."""

    trace_id: str
    span_id: str
    name: str
    service: str
    worker: str
    """The process's `service.instance.id` (the jetrl worker id), else its service name."""
    start: int
    """Unix µs."""
    duration: int
    """µs."""
    tags: dict[str, Any]
    parent: str | None
    """Span id of the CHILD_OF reference, if any."""
    links: tuple[tuple[str, str], ...]
    """(trace id, span id) of each FOLLOWS_FROM reference: the span's links."""

    @classmethod
    def of(cls, span: dict[str, Any], processes: dict[str, Any]) -> SpanView:
        process = processes.get(span.get("processID", ""), {})
        process_tags = {t["key"]: t["value"] for t in process.get("tags", [])}
        service = process.get("serviceName", "?")
        references = span.get("references") or []
        return cls(
            trace_id=span["traceID"],
            span_id=span["spanID"],
            name=span["operationName"],
            service=service,
            worker=str(process_tags.get("service.instance.id", service)),
            start=int(span["startTime"]),
            duration=int(span["duration"]),
            tags={t["key"]: t["value"] for t in span.get("tags", [])},
            parent=next((r["spanID"] for r in references if r["refType"] == "CHILD_OF"), None),
            links=tuple(
                (r["traceID"], r["spanID"]) for r in references if r["refType"] == "FOLLOWS_FROM"
            ),
        )


class Jaeger:
    """The parts of Jaeger's query HTTP API (`/api/traces`) this tool uses."""

    def __init__(self, url: str, lookback_hours: float = 48.0, timeout: float = 10.0) -> None:
        self.url = url.rstrip("/")
        self.lookback_hours = lookback_hours
        self.timeout = timeout

    def _get(self, path: str, params: dict[str, str] | None = None) -> list[dict[str, Any]]:
        url = f"{self.url}{path}" + (f"?{urllib.parse.urlencode(params)}" if params else "")
        try:
            with urllib.request.urlopen(url, timeout=self.timeout) as response:
                return json.load(response).get("data") or []
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return []
            raise TraceError(
                f"Jaeger at {self.url} answered {exc.code} to {path}: {exc.read()[:200]!r}"
            ) from None
        except (urllib.error.URLError, TimeoutError) as exc:
            raise TraceError(
                f"cannot reach Jaeger at {self.url}: {getattr(exc, 'reason', exc)}"
            ) from None
        except ValueError:  # not JSON: a URL that is not Jaeger's query service (its UI port is)
            raise TraceError(
                f"{url} did not answer with Jaeger's JSON; is --jaeger the query port (16686)?"
            ) from None

    @staticmethod
    def _spans(traces: Iterable[dict[str, Any]]) -> list[list[SpanView]]:
        return [
            [SpanView.of(span, trace.get("processes", {})) for span in trace["spans"]]
            for trace in traces
        ]

    def trace(self, trace_id: str) -> list[SpanView]:
        """Every span of one trace; empty if Jaeger has none."""
        found = self._spans(self._get(f"/api/traces/{trace_id}"))
        return found[0] if found else []

    def search(
        self, service: str, operation: str, tags: dict[str, str], limit: int = 20
    ) -> list[list[SpanView]]:
        """The traces (their spans) with a `service` span named `operation` carrying `tags`."""
        end = int(time.time() * 1e6)
        params = {
            "service": service,
            "operation": operation,
            "tags": json.dumps(tags),
            "limit": str(limit),
            "start": str(end - int(self.lookback_hours * 3600e6)),
            "end": str(end),
        }
        return self._spans(self._get("/api/traces", params))


def find(jaeger: Jaeger, key: str) -> list[list[SpanView]]:
    """The trace(s) of a trace id or a prompt id (a prompt published twice has two)."""
    if TRACE_ID.fullmatch(key.lower()):
        spans = jaeger.trace(key.lower())
        return [spans] if spans else []
    return jaeger.search(PRODUCER, "prompt", {"jetrl.prompt_id": key})


def linked(jaeger: Jaeger, spans: list[SpanView]) -> list[SpanView]:
    """The spans of other traces that link into `spans`, with their descendants (what a train
    step did next: publish the weights it made)."""
    ours = {span.span_id for span in spans}
    steps = sorted(
        {
            (str(s.tags["jetrl.run"]), int(s.tags["jetrl.step"]))
            for s in spans
            if s.name == "outcome" and "jetrl.step" in s.tags and "jetrl.run" in s.tags
        }
    )
    found: dict[str, SpanView] = {}
    for run, step in steps:
        for service, operation in LINKING:
            for trace in jaeger.search(
                service, operation, {"jetrl.run": run, "jetrl.step": str(step)}
            ):
                roots = {s.span_id for s in trace if any(span_id in ours for _, span_id in s.links)}
                found.update((s.span_id, s) for s in subtrees(trace, roots))
    return list(found.values())


def subtrees(trace: list[SpanView], roots: set[str]) -> list[SpanView]:
    """The spans of `trace` that are one of `roots` or descend from one."""
    by_id = {s.span_id: s for s in trace}

    def under(span: SpanView | None) -> bool:
        while span is not None:
            if span.span_id in roots:
                return True
            span = by_id.get(span.parent) if span.parent else None
        return False

    return [s for s in trace if under(s)]


def tree_order(spans: list[SpanView]) -> list[tuple[int, SpanView]]:
    """(depth, span) depth first, children by start time; a span whose parent is missing is a
    root."""
    ids = {s.span_id for s in spans}
    children: dict[str | None, list[SpanView]] = {}
    for span in spans:
        children.setdefault(span.parent if span.parent in ids else None, []).append(span)
    ordered: list[tuple[int, SpanView]] = []

    def visit(parent: str | None, depth: int) -> None:
        for span in sorted(children.get(parent, []), key=lambda s: (s.start, s.name)):
            ordered.append((depth, span))
            visit(span.span_id, depth + 1)

    visit(None, 0)
    return ordered


def _duration(us: int) -> str:
    return f"{us / 1e6:.3f}s" if us >= 1_000_000 else f"{us / 1e3:.1f}ms"


def details(span: SpanView) -> str:
    """What a span says beyond its name, in a few words."""
    tags = span.tags
    parts = []
    if "jetrl.step" in tags:
        parts.append(f"step {tags['jetrl.step']}")
    if tags.get("jetrl.batched") is False:
        parts.append(f"dropped: {tags.get('jetrl.drop_reason', '?')}")
    if "jetrl.sample_index" in tags:
        parts.append(f"sample {tags['jetrl.sample_index']}")
    if "jetrl.sample_id" in tags:
        parts.append(f"sample {str(tags['jetrl.sample_id']).rsplit('/', 1)[-1]}")
    if tags.get("jetrl.failed") is True:
        parts.append(f"FAILED: {tags.get('jetrl.reason', '?')}")
    elif "jetrl.reward" in tags:
        parts.append(f"reward {float(tags['jetrl.reward']):.3g}")
    if "jetrl.tokens" in tags:
        parts.append(
            f"{tags.get('jetrl.samples', '?')} samples, {tags['jetrl.tokens']} tokens, engine "
            f"{tags.get('jetrl.engine', '?')}, batch of {tags.get('jetrl.batch_prompts', '?')}"
        )
    elif "jetrl.samples" in tags:
        parts.append(f"{tags['jetrl.samples']} samples")
    parts += episode_details(tags)
    if tags.get("error") is True and "jetrl.failed" not in tags:
        parts.append("ERROR")
    return ", ".join(parts)


def episode_details(tags: dict[str, Any]) -> list[str]:
    """An agent episode's spans (`consumers.episodes`): the episode, each turn, each tool call."""
    parts = []
    if "jetrl.turns" in tags:
        resumed = int(tags.get("jetrl.resumed", 0) or 0)
        parts.append(f"{tags['jetrl.turns']} turns, ended {tags.get('jetrl.end', '?')}")
        if resumed:
            parts.append(f"resumed {resumed}x")
    if "jetrl.turn" in tags:
        parts.append(f"turn {tags['jetrl.turn']}: +{tags.get('jetrl.tokens_added', '?')} tokens")
    if "jetrl.tool" in tags:
        ok = tags.get("jetrl.ok", True)
        parts.append(f"tool {tags['jetrl.tool']}" + ("" if ok else " FAILED"))
    return parts


def _row(origin: int, depth: int, span: SpanView, note: str = "") -> tuple[str, ...]:
    """The columns of one span: offset, duration, indented name, worker, version, details."""
    version = next((f"v{span.tags[t]}" for t in VERSION_TAGS if t in span.tags), "")
    text = ", ".join(part for part in (details(span), note) if part)
    return (
        f"{(span.start - origin) / 1e6:+.3f}s",
        _duration(span.duration),
        "  " * depth + span.name,
        span.worker,
        version,
        text,
    )


def _table(rows: list[tuple[str, ...]]) -> list[str]:
    """Columns as wide as their widest cell; numbers right-aligned, text left-aligned."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    right = (True, True, False, False, True)
    lines = []
    for row in rows:
        cells = [
            cell.rjust(w) if r else cell.ljust(w)
            for cell, w, r in zip(row, widths, right, strict=False)
        ]
        lines.append("  ".join([*cells, row[-1]]).rstrip())
    return lines


def timeline(spans: list[SpanView], linked_spans: list[SpanView]) -> str:
    """The printed life of one prompt: its trace, then the spans of other traces linked to it."""
    origin = min(s.start for s in spans)
    root = next((s for s in spans if s.name == "prompt"), None)
    end = max(s.start + s.duration for s in spans)
    title = f"trace {spans[0].trace_id}"
    if root is not None:
        title += (
            f": prompt {root.tags.get('jetrl.prompt_id', '?')} "
            f"(run {root.tags.get('jetrl.run', '?')})"
        )
    rows: list[tuple[str, ...]] = [("offset", "duration", "span", "worker", "ver", "details")]
    rows += [_row(origin, depth, span) for depth, span in tree_order(spans)]
    ours = {s.span_id for s in spans}
    linked_rows = []
    for depth, span in tree_order(linked_spans):
        hits = sum(1 for _, span_id in span.links if span_id in ours)
        note = f"links {hits} of these samples, trace {span.trace_id}" if hits else ""
        linked_rows.append(_row(origin, depth, span, note))
    lines = _table(rows + linked_rows)
    if linked_rows:
        # Same columns as the trace above: the offsets say when the step came after the prompt.
        lines.insert(
            len(rows), "linked from other traces (the steps that took this prompt's samples):"
        )
    return "\n".join([f"{title}, {len(spans)} spans over {_duration(end - origin)}", *lines])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m ops.trace", description=__doc__.splitlines()[0]
    )
    parser.add_argument(
        "key",
        metavar="PROMPT_ID_OR_TRACE_ID",
        help="a prompt id (<run>/<epoch>/<index>) or a trace id",
    )
    parser.add_argument(
        "--jaeger",
        default=os.environ.get("JETRL_JAEGER_URL", DEFAULT_JAEGER),
        help=f"Jaeger query URL (default: $JETRL_JAEGER_URL, then {DEFAULT_JAEGER})",
    )
    parser.add_argument(
        "--lookback", type=float, default=48.0, help="hours back to search (default 48)"
    )
    args = parser.parse_args(argv)
    jaeger = Jaeger(args.jaeger, args.lookback)
    try:
        traces = find(jaeger, args.key)
        if not traces:
            raise TraceError(
                f"no trace for {args.key} in Jaeger at {args.jaeger} (last {args.lookback:g} h)"
            )
        print("\n\n".join(timeline(spans, linked(jaeger, spans)) for spans in traces))
    except TraceError as exc:
        print(f"ops.trace: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
