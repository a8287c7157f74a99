"""Per-role NATS users of one run: what each role may publish and subscribe to, and why.

    python -m ops.streams users --run R [--out users.conf]

writes a nats-server `authorization { users = [...] }` block with a fresh random password
per role. Include it in every node's config (`include "users.conf"`) and start each worker
with its own credential in the URL: `--nats nats://rollout:<password>@host:4222`.

How JetStream maps onto permissions: a client never subscribes to a stream's subject; it
asks the JetStream API (`$JS.API.<verb>.<stream>...`, a publish) to create a consumer or
fetch, and the server delivers to the client's `_INBOX`. So "reads stream S" means the
API verbs for S plus acks (`$JS.ACK.<S>.<consumer>.>`) or flow-control replies
(`$JS.FC.<S>.>`); "writes subject X" is a publish allow on X. Everything not allowed is
refused: the server drops the message and reports a permissions violation to the client
(whose publish then gets no ack).

Known looseness, each kept because the code needs it today:
- Every role may update the run's streams and re-declare its work queues, because every
  worker applies the topology at start-up (`consumers.runtime.attach`). Once an operator
  applies it instead, drop `declare_rules` from the workers.
- `_INBOX.>` is shared: a role could listen to another client's replies. nats-py's
  `inbox_prefix` option would let each role have its own prefix.
- A role that may create a consumer on a stream may set its deliver subject; the server
  refuses only subjects of that same stream.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping
from dataclasses import dataclass

from bus.topology import STAGES, Topology

API = "$JS.API"


@dataclass(frozen=True)
class Rule:
    """One allowed subject (NATS wildcards `*` and `>`) and the reason it is allowed."""

    subject: str
    why: str


@dataclass(frozen=True)
class Role:
    """A NATS user: one role of the run."""

    name: str
    does: str
    """One line: what the role reads and writes."""
    publish: tuple[Rule, ...]
    subscribe: tuple[Rule, ...]


def kv_stream(bucket: str) -> str:
    return f"KV_{bucket}"


def object_stream(bucket: str) -> str:
    return f"OBJ_{bucket}"


def run_streams(t: Topology) -> list[str]:
    """Every JetStream stream of the run, the KV buckets' and the object store's included."""
    return [
        *(t.stream(stage) for stage in STAGES),
        kv_stream(t.kv_bucket),
        kv_stream(t.members_bucket),
        object_stream(t.object_bucket),
    ]


# Rule sets -----------------------------------------------------------------------------


def attach_rules(t: Topology, role: str) -> list[Rule]:
    """What every role does: attach to the run, heartbeat its membership, dead-letter, get replies."""
    return [
        *(Rule(f"{API}.STREAM.INFO.{s}", "look the run's streams, KV buckets and object store up") for s in run_streams(t)),
        *declare_rules(t),
        Rule(f"{API}.STREAM.MSG.GET.{kv_stream(t.kv_bucket)}",
             "read the run's KV (config at start-up; drops and metrics are not secret)"),
        # Membership keys are `<host>_<pid>_<role>`, one token: a role cannot be told apart by subject.
        Rule(f"$KV.{t.members_bucket}.*", "write and delete this process's heartbeat entry"),
        Rule(t.subject("dead", role), "dead-letter what it cannot process, under its own stage"),
    ]


def declare_rules(t: Topology) -> list[Rule]:
    """`Topology.apply` on a run that exists: look its work queues up, declare a missing one.

    Workers never update what exists (only the operator's `ops.streams apply` does), so no
    role needs STREAM.UPDATE.
    """
    return [
        *(Rule(f"{API}.CONSUMER.INFO.{t.stream(q.stage)}.{q.durable}", "see whether the work queue exists")
          for q in t.queues.values()),
        *(Rule(f"{API}.CONSUMER.DURABLE.CREATE.{t.stream(q.stage)}.{q.durable}",
               "declare the work queue if it is missing (Topology.apply at start-up)") for q in t.queues.values()),
    ]


def create_rules(t: Topology) -> list[Rule]:
    """`Topology.apply` on a new run: create every stream, bucket and the object store."""
    return [Rule(f"{API}.STREAM.CREATE.{s}", "create the run (Topology.apply)") for s in run_streams(t)]


def work_queue_rules(t: Topology, role: str) -> list[Rule]:
    """Compete for messages on the role's durable pull consumer and settle them."""
    queue = t.queues[role]
    stream = t.stream(queue.stage)
    return [
        Rule(f"{API}.CONSUMER.MSG.NEXT.{stream}.{queue.durable}", f"fetch from its work queue on {queue.stage}"),
        Rule(f"$JS.ACK.{stream}.{queue.durable}.>", "ack, nak, term and in-progress its messages"),
    ]


def replay_rules(stream: str, what: str) -> list[Rule]:
    """Read a stream in order through an ephemeral ordered consumer (`js.subscribe(..., ordered_consumer=True)`)."""
    return [
        Rule(f"{API}.CONSUMER.CREATE.{stream}", f"open an ordered consumer to read {what}"),
        Rule(f"$JS.FC.{stream}.>", f"answer flow control while reading {what}"),
    ]


def stream_lookup_rule() -> Rule:
    return Rule(f"{API}.STREAM.NAMES", "find the stream of a subject (ordered consumers do); reveals names only")


def object_read_rules(t: Topology) -> list[Rule]:
    stream = object_stream(t.object_bucket)
    return [
        Rule(f"{API}.STREAM.MSG.GET.{stream}", "read an object's metadata"),
        *replay_rules(stream, "an object's chunks"),
    ]


def object_write_rules(t: Topology) -> list[Rule]:
    stream = object_stream(t.object_bucket)
    return [
        Rule(f"$O.{t.object_bucket}.>", "write weight chunks and their metadata"),
        Rule(f"{API}.STREAM.MSG.GET.{stream}", "see whether the object exists before replacing it"),
        Rule(f"{API}.STREAM.PURGE.{stream}", "drop the chunks of the object it replaces (this bucket only)"),
    ]


# Roles ---------------------------------------------------------------------------------


def worker_roles(t: Topology) -> tuple[Role, ...]:
    """The five roles of a run and exactly what their code does on the bus."""
    inbox = (Rule("_INBOX.>", "replies to its requests and deliveries of its consumers"),)
    weights = t.stream("weights")
    return (
        Role(
            "rollout",
            "reads prompts (work queue) and weight versions (+ object store), writes trajectories",
            (
                *attach_rules(t, "rollout"),
                *work_queue_rules(t, "rollout"),
                Rule(t.subject("trajectories"), "its output"),
                stream_lookup_rule(),
                *replay_rules(weights, "weight versions"),
                *object_read_rules(t),
            ),
            inbox,
        ),
        Role(
            "reward",
            "reads trajectories (work queue), writes rewards",
            (
                *attach_rules(t, "reward"),
                *work_queue_rules(t, "reward"),
                Rule(t.subject("rewards"), "its output"),
            ),
            inbox,
        ),
        Role(
            "buffer",
            "reads rewards (work queue) and replays batches at start-up, writes batches and KV drops",
            (
                *attach_rules(t, "buffer"),
                *work_queue_rules(t, "buffer"),
                Rule(t.subject("batches", "*"), "its output, one subject per data-parallel rank"),
                stream_lookup_rule(),
                *replay_rules(t.stream("batches"), "the batches already stored"),
                Rule(f"$KV.{t.kv_bucket}.drop.>", "record a dropped group for the admission gate"),
            ),
            inbox,
        ),
        Role(
            "trainer",
            "reads batches (by position), writes weight versions (+ object store) and KV metrics",
            (
                *attach_rules(t, "trainer"),
                stream_lookup_rule(),
                *replay_rules(t.stream("batches"), "its rank's batches from its checkpoint on"),
                Rule(t.subject("weights"), "announce a weight version"),
                *object_write_rules(t),
                Rule(f"$KV.{t.kv_bucket}.metrics.>", "per-step metrics"),
            ),
            inbox,
        ),
        Role(
            "producer",
            "creates the run, writes prompts and the KV config; follows weights, KV and queue lag",
            (
                *attach_rules(t, "producer"),
                *create_rules(t),
                Rule(t.subject("prompts"), "its output"),
                Rule(f"$KV.{t.kv_bucket}.config", "the run's config, read by every worker"),
                Rule(f"{API}.STREAM.MSG.GET.{t.stream('prompts')}", "resume after the last prompt stored"),
                stream_lookup_rule(),
                *replay_rules(weights, "weight versions (the admission gate)"),
                *replay_rules(kv_stream(t.kv_bucket), "drops and metrics"),
                Rule(f"{API}.CONSUMER.INFO.{kv_stream(t.kv_bucket)}.*",
                     "kv.watch asks its own watcher how many entries are pending"),
                *(Rule(f"{API}.CONSUMER.INFO.{t.stream(q.stage)}.{q.durable}", "show the work queues' lag")
                  for q in t.queues.values()),
                Rule(f"{API}.STREAM.MSG.GET.{kv_stream(t.members_bucket)}",
                     "a stalled run: name the roles with no live worker (ops.stall)"),
                Rule(f"{API}.STREAM.MSG.GET.{t.stream('batches')}",
                     "a stalled run: name the micro-batches the trainer waits for (ops.stall)"),
            ),
            inbox,
        ),
    )


def admin_role(t: Topology) -> Role:
    """The operator (ops.streams, ops.status, ops.audit): everything about this run, nothing of others."""
    publish = [
        Rule(f"{API}.INFO", "account limits and usage"),
        Rule(f"{API}.STREAM.NAMES", "list streams"),
        Rule(f"{API}.STREAM.LIST", "list streams"),
        Rule(t.subject(">"), "republish dead letters, inject test events"),
        Rule(f"$KV.{t.kv_bucket}.>", "edit the run's KV"),
        Rule(f"$KV.{t.members_bucket}.>", "remove a stale member"),
        Rule(f"$O.{t.object_bucket}.>", "manage weight objects"),
    ]
    for s in run_streams(t):
        publish += [
            Rule(f"{API}.STREAM.*.{s}", "create, update, delete, purge, inspect"),
            Rule(f"{API}.STREAM.MSG.*.{s}", "get or delete one message"),
            Rule(f"{API}.DIRECT.GET.{s}.>", "read the last message of a subject"),
            Rule(f"{API}.CONSUMER.*.{s}", "create ephemeral consumers, list consumers"),
            Rule(f"{API}.CONSUMER.*.{s}.>", "inspect, delete, create named consumers, fetch"),
            Rule(f"{API}.CONSUMER.DURABLE.CREATE.{s}.>", "declare work queues"),
            Rule(f"$JS.ACK.{s}.>", "settle messages by hand"),
            Rule(f"$JS.FC.{s}.>", "read with ordered consumers"),
        ]
    return Role("admin", "operator: declares, inspects, repairs and deletes this run", tuple(publish),
                (Rule("_INBOX.>", "replies and deliveries"),))


def roles(t: Topology) -> tuple[Role, ...]:
    return (*worker_roles(t), admin_role(t))


# Rendering -----------------------------------------------------------------------------


def new_passwords(t: Topology) -> dict[str, str]:
    """A random password per role; URL-safe, so it can sit in a nats:// URL as is."""
    return {role.name: secrets.token_urlsafe(24) for role in roles(t)}


def _allow(rules: tuple[Rule, ...], indent: str) -> str:
    return "".join(f'{indent}"{rule.subject}"  # {rule.why}\n' for rule in rules)


def users_config(t: Topology, passwords: Mapping[str, str]) -> str:
    """The nats-server `authorization` block of run `t.run`, one user per role."""
    users = []
    for role in roles(t):
        users.append(
            f"    # {role.name}: {role.does}\n"
            "    {\n"
            f'      user: "{role.name}"\n'
            f'      password: "{passwords[role.name]}"\n'
            "      permissions: {\n"
            "        publish: { allow: [\n"
            f"{_allow(role.publish, ' ' * 10)}"
            "        ] }\n"
            "        subscribe: { allow: [\n"
            f"{_allow(role.subscribe, ' ' * 10)}"
            "        ] }\n"
            "      }\n"
            "    }\n"
        )
    return (
        f"# NATS users of jetrl run {t.run}, one per role: `python -m ops.streams users --run {t.run}`.\n"
        "# Include from every node's config (include \"users.conf\") and connect each worker as\n"
        "#     --nats nats://<role>:<password>@host:4222\n"
        "# The passwords are in plain text: keep this file readable by the server's user only.\n"
        "# One run per server: a second `authorization` block would replace this one.\n"
        "authorization {\n"
        "  users = [\n"
        f"{''.join(users)}"
        "  ]\n"
        "}\n"
    )
