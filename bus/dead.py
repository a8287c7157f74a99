"""Dead letters (the `DEAD` channel): the original bytes and the reason,
on `rl.<run>.dead.<stage>`."""

from __future__ import annotations

from nats.aio.msg import Msg

from bus.publisher import Publisher
from bus.topology import DEAD

REASON = "Jetrl-Dead-Reason"
STAGE = "Jetrl-Dead-Stage"
SUBJECT = "Jetrl-Original-Subject"
SEQUENCE = "Jetrl-Original-Sequence"
DELIVERIES = "Jetrl-Deliveries"
TRUNCATED = "Jetrl-Original-Size"
"""Set when the stored bytes are only the start of the original (its size in bytes)."""
# Room left for the headers (these, the message id, the trace context) under the max payload.
HEADERS_ROOM = 4096


async def dead_letter(publisher: Publisher, stage: str, msg: Msg, reason: str) -> None:
    """Store `msg` as a dead letter of `stage`; idempotent per original stream sequence."""
    meta = msg.metadata
    await dead_letter_bytes(
        publisher,
        stage,
        msg.data,
        msg.subject,
        meta.stream,
        meta.sequence.stream,
        meta.num_delivered,
        reason,
    )


async def dead_letter_bytes(
    publisher: Publisher,
    stage: str,
    data: bytes,
    subject: str,
    stream: str,
    seq: int,
    deliveries: int,
    reason: str,
) -> None:
    """Store the bytes of message `seq` of `stream` (on `subject`) as a dead letter of `stage`:
    for messages read without a delivery (`get_msg`, an ordered consumer) as for acked ones.
    Idempotent per original stream sequence."""
    # Headers are one line each: keep the reason short and printable.
    reason = " ".join(reason.split())[:900]
    headers = {
        REASON: reason,
        STAGE: stage,
        SUBJECT: subject,
        SEQUENCE: str(seq),
        DELIVERIES: str(deliveries),
    }
    msg_id = f"dead/{stage}/{stream}/{seq}"
    # A message just under the max payload cannot go back out with headers added: keep its
    # start (enough to see what it was) rather than fail the dead letter again on every delivery.
    if len(data) > publisher.max_payload - HEADERS_ROOM:
        data, headers[TRUNCATED] = data[: publisher.max_payload - HEADERS_ROOM], str(len(data))
    await (await publisher.send_bytes(DEAD, data, msg_id, stage, headers=headers))
