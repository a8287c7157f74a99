"""Weight versions broadcast from the trainer over torch.distributed: NCCL on GPUs, gloo on CPU.

The source (trainer rank 0) hosts a TCPStore, the control plane of every broadcast; its `address`
is what the weights event announces. Per version and attempt the source writes a plan (the
candidates `alive()` names, the tensor slots, which trainer rank sends which bucket:
`engines.collective_plan`), waits at most join_timeout_s for each candidate's
yes/no, writes the start (epoch, members), broadcasts bucket by bucket, and writes the outcome
(delivered | retry | gave_up). A new epoch (process group) opens whenever the members differ or
an attempt failed: every broadcast has a timeout and a deadline of our own, so a dead or stalled
member costs one attempt, never a hang. With several trainer ranks, ranks 1.. join each group
too (`engines.collective_peer`) and broadcast the buckets of their own tensors (src = their rank). A
worker left out gets `Missed` and catches up from the object store or filesystem. Loads are all or
nothing (`into` is written once every bucket arrived). Groups are bare backend objects, not the
default group, so the trainer's and a rollout engine's own groups stay untouched. When a member
checks in as an engine (it receives into the engine's own memory, through the engine's own
weight-update calls), the attempt runs in tensor mode: one broadcast per tensor, in a group made
as SGLang makes its own (`engines.collective_tensors`, `engines.collective_engine`). The protocol,
in full: docs/weights.md, "Collective transport". What the source, the receivers, the peers and
the engine workers share (settings, results, the group of an epoch, the bounded waits, a
sender's buckets) is `engines.collective_group`; its public names are importable from here.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import cast

import torch
import torch.distributed as dist

from engines.collective_group import (
    _KEEP_VERSIONS,
    CollectiveSettings,
    Missed,
    Published,
    Received,
    _drop,
    _Group,
    _open_group,
    _poll,
    _until,
    _wait,
    send_buckets,
)
from engines.collective_plan import Into, Spec, layout, misfit, sent_by, specs_of
from engines.collective_tensors import (
    ENGINE,
    open_tensor_group,
    place,
    ranks_of,
    receive_tensors,
    send_tensors,
    start_of,
)


class CollectiveSource:
    """Trainer rank 0: broadcasts versions to the members `alive()` names (rollout worker ids),
    and coordinates every attempt (plan, check-ins, start, outcome). With `senders` > 1 the
    trainer ranks 1.. take part as `CollectivePeer`s (group ranks 1..senders-1), each sending
    the buckets of the tensors it owns; the rollout workers follow as ranks senders, ..."""

    def __init__(self, alive: Callable[[], Sequence[str]], settings: CollectiveSettings,
                 host: str = "127.0.0.1", port: int = 0, senders: int = 1) -> None:  # fmt: skip
        if senders < 1:
            raise ValueError(f"senders must be >= 1, got {senders}")
        self._alive, self._s, self.senders = alive, settings, senders
        t = timedelta(seconds=settings.join_timeout_s)
        self._store = dist.TCPStore(host, port, None, True, t, wait_for_workers=False)
        self.address = (host, self._store.port)
        self._store.set("latest", "-1")
        self._group: _Group | None = None
        self._epoch = 0  # bumped by every new group
        self._keys: dict[int, list[str]] = {}
        self._bufs = [torch.empty(0, dtype=torch.uint8, device=settings.device)] * 2
        self._answers: dict[str, str] = {}

    def _set(self, version: int, key: str, value: str) -> None:
        self._keys.setdefault(version, []).append(key)
        self._store.set(key, value)

    def publish(
        self,
        version: int,
        tensors: Mapping[str, torch.Tensor],
        owned: Sequence[Sequence[Spec]] | None = None,
    ) -> Published:
        """Broadcast `version`; returns once delivered or given up (never hangs). `tensors`: this
        rank's own; `owned[r]`: the specs of the tensors sender r owns (default:
        `tensors`, alone)."""
        started = time.monotonic()
        owned = owned if owned is not None else [specs_of(tensors)]
        if len(owned) != self.senders:
            raise ValueError(
                f"v{version}: {len(owned)} senders' tensors, the source has {self.senders} senders"
            )
        slots, total, buckets = layout(owned, self._s.bucket_bytes)
        self._store.set("latest", str(version))
        reason, attempt = "no attempt", 0
        for attempt in range(self._s.max_attempts):
            key = f"v{version}/a{attempt}"
            candidates = sorted(set(self._alive()))
            plan = {
                "candidates": candidates,
                "slots": slots,
                "total": total,
                "buckets": buckets,
                "senders": self.senders,
            }
            self._set(version, f"{key}/plan", json.dumps(plan))
            self._keys[version] += [
                f"{key}/ready/{m}" for m in candidates
            ]  # written by the receivers
            ranks = self._check_ins(key, candidates)
            members = tuple(ranks)
            if not members:
                self._set(
                    version, f"{key}/start", json.dumps({"epoch": self._epoch, "members": []})
                )
                reason = "no member checked in"
                break
            engines = any(self._answers.get(m, "").startswith(ENGINE) for m in members)
            shape = (*members, *(f"{m}={n}" for m, n in ranks.items()), str(engines))
            if self._group is None or self._group.members != shape:
                _drop(self._group)
                self._group, self._epoch = None, self._epoch + 1
            start = start_of(self._epoch, ranks, engines, self.senders, self.address[1])
            self._set(version, f"{key}/start", json.dumps(start))
            try:
                if self._group is None:
                    self._group = self._open(start, shape)
                if start["mode"] == "tensors":
                    sent = send_tensors(slots, tensors, lambda t: self._send(t), self._s.device)
                else:
                    sent, self._bufs = send_buckets(
                        self._group, 0, plan, tensors, self._bufs, self._s
                    )
            except (
                RuntimeError,
                TimeoutError,
            ) as exc:  # a member died or stalled: rebuild without it
                _drop(self._group)
                self._group = None
                reason = f"attempt {attempt} failed: {str(exc).splitlines()[0][:200]}"
                self._set(
                    version,
                    f"{key}/outcome",
                    "gave_up" if attempt + 1 == self._s.max_attempts else "retry",
                )
                continue
            self._set(version, f"{key}/outcome", "delivered")
            self._forget(version)
            return Published(
                version,
                self._epoch,
                members,
                attempt + 1,
                time.monotonic() - started,
                total,
                sent=sent,
            )
        self._forget(version)
        return Published(
            version, self._epoch, (), attempt + 1, time.monotonic() - started, total, reason
        )

    def _open(self, start: dict, shape: tuple[str, ...]) -> _Group:
        """The epoch's group: bare (bucket mode) or as the engines make theirs (tensors)."""
        if start["mode"] == "tensors":
            backend = open_tensor_group(self._store, 0, start["size"], start["group"], self._s)
            return _Group(self._epoch, shape, backend)
        prefix = dist.PrefixStore(f"epoch{self._epoch}/", self._store)
        return _Group(self._epoch, shape, _open_group(prefix, 0, start["size"], self._s))

    def _send(self, tensor: torch.Tensor) -> None:
        assert self._group is not None
        _wait(self._group.broadcast(tensor, 0, self._s.op_timeout_s), self._s.op_timeout_s)

    def _check_ins(self, key: str, candidates: list[str]) -> dict[str, int]:
        """The candidates that said yes (or `engine:N`) within join_timeout_s, with the group
        ranks each takes (a "no" ends the wait for that one)."""
        answers: dict[str, str] = {}
        self._answers = answers

        def all_in() -> bool:
            for m in candidates:
                if m not in answers and self._store.check([f"{key}/ready/{m}"]):
                    answers[m] = self._store.get(f"{key}/ready/{m}").decode()
            return len(answers) == len(candidates)

        _until(all_in, self._s.join_timeout_s)
        return ranks_of({m: answers[m] for m in candidates if m in answers})

    def _forget(self, version: int) -> None:
        for old in [v for v in self._keys if v <= version - _KEEP_VERSIONS]:
            for key in self._keys.pop(old):
                self._store.delete_key(key)

    def close(self) -> None:
        """Drop the group and the store; receivers still waiting get Missed (source unreachable)."""
        _drop(self._group)
        self._group = None
        del self._store


class CollectiveReceiver:
    """A rollout worker's side; `member_id` is the id `alive()` names it by on the source."""

    def __init__(self, member_id: str, settings: CollectiveSettings) -> None:
        self.member_id, self._s = member_id, settings
        self._address: tuple[str, int] | None = None
        self._store: dist.TCPStore | None = None
        self._group: _Group | None = None
        self._staging: torch.Tensor | None = None

    def receive(
        self, address: tuple[str, int], version: int, into: Into = None,
        checksums: Mapping[str, str] | None = None,
        on_bucket: Callable[[int, int], None] | None = None,
    ) -> Received | Missed:  # fmt: skip
        """Take part in `version`'s broadcast from the source at `address`.

        `into` is written only once the whole version arrived (a dtype that differs is cast);
        `checksums` (sha256 per tensor name) are checked before that; `on_bucket(k, count)` runs
        after each bucket (progress, heartbeats).
        """
        started, t = time.monotonic(), timedelta(seconds=self._s.join_timeout_s)
        try:
            if self._store is None or self._address != tuple(address):
                self.close()
                self._store = dist.TCPStore(address[0], address[1], None, False, t)
                # tuple(): the address may come as a JSON list.
                self._address = cast(tuple[str, int], tuple(address))
            got = self._attempts(self._store, version, into, on_bucket)
        except RuntimeError as exc:  # the store went away: the source died or closed
            self.close()
            return Missed(version, f"source unreachable: {str(exc).splitlines()[0][:200]}")
        if isinstance(got, Missed):
            return got
        plan, staging = got
        slots = plan["slots"]
        tensors = {
            name: staging[off : off + n].view(getattr(torch, dt)).view(shape)
            for name, dt, shape, off, n in slots
        }
        for name, digest in (checksums or {}).items():
            raw = (
                tensors[name].reshape(-1).view(torch.uint8).cpu().numpy()
                if name in tensors
                else b""
            )
            # An ndarray is a buffer; numpy's stubs declare that for Python 3.12+ only.
            if hashlib.sha256(raw).hexdigest() != digest:  # type: ignore[arg-type]
                return Missed(version, f"checksum mismatch on {name}")
        if into is not None:
            dest = into.state_dict() if isinstance(into, torch.nn.Module) else into
            with torch.no_grad():
                for name, tensor in tensors.items():
                    dest[name].copy_(tensor)
        by_src = sent_by([tuple(b) for b in plan["buckets"]])
        return Received(version, tensors, time.monotonic() - started, staging.numel(), by_src)

    def _attempts(
        self,
        store: dist.TCPStore,
        version: int,
        into: Into,
        on_bucket: Callable[[int, int], None] | None,
    ) -> tuple[dict, torch.Tensor] | Missed:
        s, superseded = self._s, lambda: int(store.get("latest")) > version
        for attempt in range(s.max_attempts):
            key = f"v{version}/a{attempt}"
            raw = _poll(
                store,
                f"{key}/plan",
                s.join_timeout_s,
                superseded if attempt == 0 else lambda: False,
            )
            if raw is None:
                return Missed(
                    version,
                    "superseded by a newer version"
                    if superseded()
                    else "no plan from the source in time",
                )
            plan = json.loads(raw)
            if self.member_id not in plan["candidates"]:
                return Missed(
                    version, "not a member of this version's group (alive() did not list it)"
                )
            why = misfit(plan["slots"], into)
            store.set(f"{key}/ready/{self.member_id}", "no" if why else "yes")
            if why:
                return Missed(version, why)
            start = json.loads(
                _poll(store, f"{key}/start", s.join_timeout_s + s.op_timeout_s) or '{"members": []}'
            )
            if self.member_id not in start["members"]:
                return Missed(
                    version, "checked in too late: the version went out without this worker"
                )
            if store.check([f"{key}/outcome"]) and store.get(f"{key}/outcome") == b"delivered":
                return Missed(version, "the version already went out")
            try:
                return plan, self._join_and_receive(
                    store, key, plan, start, into is None, on_bucket
                )
            except (RuntimeError, TimeoutError) as exc:
                _drop(self._group)
                self._group = None
                outcome = _poll(store, f"{key}/outcome", s.op_timeout_s + s.join_timeout_s)
                if outcome != "retry":
                    return Missed(
                        version,
                        f"broadcast failed ({str(exc).splitlines()[0][:120]}), outcome {outcome}",
                    )
        return Missed(version, "the source gave up on this version")

    def _join_and_receive(
        self, store: dist.TCPStore, key: str, plan: dict, start: dict, fresh: bool,
        on_bucket: Callable[[int, int], None] | None,
    ) -> torch.Tensor:  # fmt: skip
        members, s = tuple(start["members"]), self._s
        tensor_mode = start.get("mode") == "tensors"
        if (
            self._group is None
            or self._group.epoch != start["epoch"]
            or self._group.members != members
        ):
            _drop(self._group)
            self._group = None
            # The trainer ranks are group ranks 0..senders-1, the members follow.
            rank, size = place(start, self.member_id, plan["senders"])
            if tensor_mode:
                backend = open_tensor_group(store, rank, size, start["group"], s)
                self._group = _Group(start["epoch"], members, backend)
            else:
                prefix = dist.PrefixStore(f"epoch{start['epoch']}/", store)
                self._group = _Group(start["epoch"], members, _open_group(prefix, rank, size, s))
        total, buckets = plan["total"], plan["buckets"]
        # A new buffer when the caller keeps the views (into=None), so earlier versions stay intact.
        if fresh or self._staging is None or self._staging.numel() != total:
            self._staging = torch.empty(total, dtype=torch.uint8, device=s.device)

        def abandoned() -> bool:
            return store.check([f"{key}/outcome"]) and store.get(f"{key}/outcome") != b"delivered"

        group = self._group
        if tensor_mode:  # one broadcast per tensor, into its view of the staging buffer
            receive_tensors(
                plan["slots"],
                self._staging,
                lambda t: _wait(group.broadcast(t, 0, s.op_timeout_s), s.op_timeout_s, abandoned),
            )
            return self._staging
        for k, (src, lo, hi) in enumerate(
            buckets
        ):  # each straight into its slice of the staging buffer
            _wait(
                self._group.broadcast(self._staging[lo:hi], src, s.op_timeout_s),
                s.op_timeout_s,
                abandoned,
            )
            if on_bucket is not None:
                on_bucket(k, len(buckets))
        return self._staging

    def close(self) -> None:
        _drop(self._group)
        self._group, self._store, self._address = None, None, None
