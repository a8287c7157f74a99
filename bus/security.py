"""Per-role NATS users of one run: what each role may publish and subscribe to, and why.

    python -m ops.streams users --run R --out DIR

writes DIR/users.conf, a nats-server `authorization { users = [...] }` block that names each
role by the public key of a fresh nkey (no secret in it), and DIR/<role>.nk, each role's seed,
readable by its owner only. Include users.conf in every node's config (`include "users.conf"`)
and start each worker with its own seed file: `--identity DIR/rollout.nk` (bus.identity), so
no credential is on a command line or in an environment.

How JetStream maps onto permissions: a client never subscribes to a stream's subject; it
asks the JetStream API (`$JS.API.<verb>.<stream>...`, a publish) to create a consumer or
fetch, and the server delivers to the client's `_INBOX`. So "reads stream S" means the
API verbs for S plus acks (`$JS.ACK.<S>.<consumer>.>`) or flow-control replies
(`$JS.FC.<S>.>`); "writes subject X" is a publish allow on X. Everything not allowed is
refused: the server drops the message and reports a permissions violation to the client
(whose publish then gets no ack).

What each role publishes and reads comes from the channel table (`bus.topology.CHANNELS`:
publishers, readers and how they read) and the KV key table (`KV_KEYS`: writers); only what
the table does not describe (the object store's weight bytes, creating the run, the
producer's KV watch) is written out per role below.

Known looseness, each kept because the code needs it today:
- Every role may update the run's streams and re-declare its work queues, because every
  worker applies the topology at start-up (`bus.runtime.attach`). Once an operator
  applies it instead, drop `declare_rules` from the workers.
- `_INBOX.>` is shared: a role could listen to another client's replies. nats-py's
  `inbox_prefix` option would let each role have its own prefix.
- A role that may create a consumer on a stream may set its deliver subject; the server
  refuses only subjects of that same stream.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from bus.identity import identity_path, new_seed, public_key, write_private
from bus.topology import (
    BATCHES,
    CHANNELS,
    DEAD,
    DECLARED,
    EVERY_WORK_QUEUE,
    KV_KEYS,
    REWARDS,
    SCORED,
    TRAJECTORIES,
    WEIGHTS,
    Channel,
    Read,
    Topology,
)

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
        *(t.stream(channel) for channel in CHANNELS),
        kv_stream(t.kv_bucket),
        kv_stream(t.members_bucket),
        object_stream(t.object_bucket),
    ]


# Rule sets -----------------------------------------------------------------------------


def attach_rules(t: Topology, role: str) -> list[Rule]:
    """What every role does: attach to the run, heartbeat its membership, dead-letter,
    get replies."""
    return [
        *(
            Rule(f"{API}.STREAM.INFO.{s}", "look the run's streams, KV buckets and object store up")
            for s in run_streams(t)
        ),
        *declare_rules(t),
        Rule(
            f"{API}.STREAM.MSG.GET.{kv_stream(t.kv_bucket)}",
            "read the run's KV (config at start-up; drops and metrics are not secret)",
        ),
        # Membership keys are `<host>_<pid>_<role>`, one token:
        # a role cannot be told apart by subject.
        Rule(f"$KV.{t.members_bucket}.*", "write and delete this process's heartbeat entry"),
    ]


def declare_rules(t: Topology) -> list[Rule]:
    """`Topology.apply` on a run that exists: look its work queues up, declare a missing one.

    Workers never update what exists (only the operator's `ops.streams apply` does), so no
    role needs STREAM.UPDATE.
    """
    return [
        *(
            Rule(
                f"{API}.CONSUMER.INFO.{t.stream(c)}.{c.work_queue.durable}",
                "see whether the work queue exists, and its lag",
            )
            for c in EVERY_WORK_QUEUE
        ),
        *(
            Rule(
                f"{API}.CONSUMER.DURABLE.CREATE.{t.stream(c)}.{c.work_queue.durable}",
                "declare the work queue if it is missing (Topology.apply at start-up)",
            )
            for c in EVERY_WORK_QUEUE
        ),
    ]


def create_rules(t: Topology) -> list[Rule]:
    """`Topology.apply` on a new run: create every stream, bucket and the object store."""
    return (
        [
            Rule(f"{API}.STREAM.CREATE.{s}", "create the run (Topology.apply)")
            for s in run_streams(t)
        ]
        + [
            Rule(
                f"{API}.STREAM.UPDATE.{t.stream(c)}",
                "switch a new work stream to interest retention once its work queue exists",
            )
            for c in (TRAJECTORIES, REWARDS, SCORED)
        ]
        + [
            Rule(
                f"{API}.STREAM.UPDATE.{s}",
                "give a new bucket's stream the run's streams.max_consumers (Topology.apply)",
            )
            for s in (
                kv_stream(t.kv_bucket),
                kv_stream(t.members_bucket),
                object_stream(t.object_bucket),
            )
        ]
    )


def work_queue_rules(t: Topology, channel: Channel) -> list[Rule]:
    """Compete for messages on the channel's durable pull consumer and settle them."""
    durable, stream = channel.work_queue.durable, t.stream(channel)
    return [
        Rule(
            f"{API}.CONSUMER.MSG.NEXT.{stream}.{durable}",
            f"fetch from its work queue on {channel.name}",
        ),
        Rule(f"$JS.ACK.{stream}.{durable}.>", "ack, nak, term and in-progress its messages"),
    ]


def replay_rules(stream: str, what: str) -> list[Rule]:
    """Read a stream in order through an ephemeral ordered consumer
    (`js.subscribe(..., ordered_consumer=True)`)."""
    return [
        Rule(f"{API}.CONSUMER.CREATE.{stream}", f"open an ordered consumer to read {what}"),
        Rule(f"$JS.FC.{stream}.>", f"answer flow control while reading {what}"),
    ]


def stream_lookup_rule() -> Rule:
    return Rule(
        f"{API}.STREAM.NAMES",
        "find the stream of a subject (ordered consumers do); reveals names only",
    )


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
        Rule(
            f"{API}.STREAM.PURGE.{stream}",
            "drop the chunks of the versions it prunes (this bucket only)",
        ),
        stream_lookup_rule(),
        *replay_rules(stream, "the objects' metadata, to prune old versions"),
    ]


# Roles ---------------------------------------------------------------------------------


def publish_rules(t: Topology, role: str) -> list[Rule]:
    """The channels `role` publishes, one subject per rank or stage where the channel has a token
    (dead letters under the role's own stage only), and the KV keys it writes."""
    rules = []
    for channel in CHANNELS:  # both readings of `rewards` have the same publishers
        if role not in channel.publishers:
            continue
        if channel is DEAD:
            rules.append(
                Rule(
                    t.subject(DEAD, role), "dead-letter what it cannot process, under its own stage"
                )
            )
        else:
            subject = t.subject(channel, "*") if channel.token else t.subject(channel)
            per = f", one subject per {channel.token}" if channel.token else ""
            rules.append(Rule(subject, f"publish {channel.name}{per}"))
    return rules + [
        Rule(f"$KV.{t.kv_bucket}.{key.filter}", key.why) for key in KV_KEYS if role in key.writers
    ]


def read_rules(t: Topology, role: str) -> list[Rule]:
    """How `role` reads each channel it reads, as the table says."""
    rules: list[Rule] = []
    for channel in DECLARED:
        for reader in (r for r in channel.readers if r.role == role):
            what = f"{channel.name} ({reader.read.value})"
            if reader.read is Read.WORK_QUEUE:
                rules += work_queue_rules(t, channel)
            elif reader.read is Read.LAST_STORED:
                rules.append(Rule(f"{API}.STREAM.MSG.GET.{t.stream(channel)}", f"read {what}"))
            else:  # an ordered consumer, found by subject
                rules += [stream_lookup_rule(), *replay_rules(t.stream(channel), what)]
    return list(dict.fromkeys(rules))


def extra_rules(t: Topology, role: str) -> list[Rule]:
    """What a role does on the bus that the channel and KV tables do not describe."""
    return {
        "rollout": [
            *object_read_rules(t),
            Rule(
                f"{API}.STREAM.MSG.GET.{t.stream(WEIGHTS)}",
                "a version whose bytes are gone: "
                "is a newer one announced (the last weights event)?",
            ),
            Rule(
                f"{API}.STREAM.MSG.GET.{kv_stream(t.members_bucket)}",
                "placement colocated: is the device's holder alive (bus.lease)?",
            ),
        ],
        "trainer": [
            *object_write_rules(t),
            Rule(
                f"{API}.STREAM.PURGE.{t.stream(BATCHES)}",
                "delete the batches no restart from its committed checkpoint can need "
                "(its own rank's subject)",
            ),
            Rule(
                f"{API}.STREAM.MSG.GET.{kv_stream(t.members_bucket)}",
                "collective weights: the live rollout workers a version is broadcast to; "
                "placement colocated: is the device's holder alive (bus.lease)?",
            ),
        ],
        "producer": [
            *create_rules(t),
            *replay_rules(kv_stream(t.kv_bucket), "drops and metrics (kv.watch)"),
            Rule(
                f"{API}.CONSUMER.INFO.{kv_stream(t.kv_bucket)}.*",
                "kv.watch asks its own watcher how many entries are pending",
            ),
            Rule(
                f"{API}.STREAM.MSG.GET.{kv_stream(t.members_bucket)}",
                "a stalled run: name the roles with no live worker (producers.stall)",
            ),
            Rule(
                f"{API}.STREAM.MSG.GET.{t.stream(BATCHES)}",
                "a stalled run: name the micro-batches the trainer waits for (producers.stall)",
            ),
        ],
    }.get(role, [])


def table_roles() -> tuple[str, ...]:
    """Every role the channel and KV tables name, in the order they first appear."""
    names = [r for c in DECLARED for r in (*c.publishers, *c.consumers)] + [
        w for k in KV_KEYS for w in k.writers
    ]
    return tuple(dict.fromkeys(names))


def does(role: str) -> str:
    """One line, from the table: what the role reads (and how) and writes."""
    reads = list(
        dict.fromkeys(
            f"{c.name} ({r.read.value})" for c in DECLARED for r in c.readers if r.role == role
        )
    )
    writes = [c.name for c in CHANNELS if role in c.publishers and c is not DEAD]
    writes += [f"KV {k.pattern}" for k in KV_KEYS if role in k.writers]
    return f"reads {', '.join(reads) or 'nothing'}; writes {', '.join(writes) or 'nothing'}"


def worker_roles(t: Topology) -> tuple[Role, ...]:
    """The roles of a run and exactly what their code does on the bus."""
    inbox = (Rule("_INBOX.>", "replies to its requests and deliveries of its consumers"),)
    return tuple(
        Role(
            role,
            does(role),
            tuple(
                dict.fromkeys(
                    [
                        *attach_rules(t, role),
                        *publish_rules(t, role),
                        *read_rules(t, role),
                        *extra_rules(t, role),
                    ]
                )
            ),
            inbox,
        )
        for role in table_roles()
    )


def admin_role(t: Topology) -> Role:
    """The operator (ops.streams, ops.status, ops.audit): everything about this run,
    nothing of others."""
    publish = [
        Rule(f"{API}.INFO", "account limits and usage"),
        Rule(f"{API}.STREAM.NAMES", "list streams"),
        Rule(f"{API}.STREAM.LIST", "list streams"),
        Rule(t.all_subjects, "republish dead letters, inject test events"),
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
    return Role(
        "admin",
        "operator: declares, inspects, repairs and deletes this run",
        tuple(publish),
        (Rule("_INBOX.>", "replies and deliveries"),),
    )


def roles(t: Topology) -> tuple[Role, ...]:
    return (*worker_roles(t), admin_role(t))


# Rendering -----------------------------------------------------------------------------


def new_seeds(t: Topology) -> dict[str, bytes]:
    """A fresh user nkey seed per role (`bus.identity.new_seed`)."""
    return {role.name: new_seed() for role in roles(t)}


def _allow(rules: tuple[Rule, ...], indent: str) -> str:
    return "".join(f'{indent}"{rule.subject}"  # {rule.why}\n' for rule in rules)


def users_config(t: Topology, public_keys: Mapping[str, str]) -> str:
    """The nats-server `authorization` block of run `t.run`, one user per role, named by its
    nkey's public key (`public_keys[role]`, `U...`)."""
    users = []
    for role in roles(t):
        users.append(
            f"    # {role.name}: {role.does}\n"
            "    {\n"
            f'      nkey: "{public_keys[role.name]}"\n'
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
        f"# NATS users of jetrl run {t.run}, one per role: "
        f"`python -m ops.streams users --run {t.run}`.\n"
        '# Include from every node\'s config (include "users.conf") and start each worker with\n'
        "#     --identity <role>.nk   (the role's seed file, written beside this one, mode 600)\n"
        "# Only public keys are here: the seeds never reach a server.\n"
        "# One run per server: a second `authorization` block would replace this one.\n"
        "authorization {\n"
        "  users = [\n"
        f"{''.join(users)}"
        "  ]\n"
        "}\n"
    )


USERS_FILE = "users.conf"


def write_identities(t: Topology, directory: Path) -> dict[str, Path]:
    """Both sides of run `t`'s identities in `directory` (made owner-only): each role's seed in
    `<role>.nk` (mode 600) and the server's `users.conf` with their public keys. Returns the
    seed files by role."""
    directory.mkdir(parents=True, exist_ok=True)
    directory.chmod(0o700)
    seeds = new_seeds(t)
    paths = {}
    for role, seed in seeds.items():
        paths[role] = identity_path(role, directory)
        write_private(paths[role], seed + b"\n")
    # No secret in it, but it decides who may do what: owner-only as well.
    write_private(
        directory / USERS_FILE,
        users_config(t, {r: public_key(s) for r, s in seeds.items()}).encode(),
    )
    return paths
