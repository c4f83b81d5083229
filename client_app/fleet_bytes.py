"""The bytes Flower's Fleet API moves for a call and its reply, as Flower counts a run's traffic
itself (`flwr ls`'s `network-traffic`): the ClientApp puts them in its reply's metrics
(`message_bytes_down`, `message_bytes_up`), so metrics.jsonl's `message_bytes` agrees with
Flower's count (invariant 41). Flower types stay at the Flower edge: `fl_app` only adds them up."""

from __future__ import annotations

from uuid import UUID

from flwr.app import Message, RecordDict
from flwr.common.serde import error_to_proto, metadata_to_proto, recorddict_to_proto
from flwr.proto.fleet_pb2 import (
    PullMessagesRequest,
    PullMessagesResponse,
    PushMessagesRequest,
    PushMessagesResponse,
    Reconnect,
)
from flwr.proto.message_pb2 import Message as ProtoMessage
from flwr.proto.message_pb2 import ObjectTree
from flwr.proto.node_pb2 import Node
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects, get_object_tree, no_object_id_recompute

from fl_app.accounting import MESSAGE_DOWN, MESSAGE_UP

UNCOUNTED = {MESSAGE_DOWN: 0.0, MESSAGE_UP: 0.0}  # what `count_reply` fills in (doubles, as the counts)


def _objects(msg: Message) -> tuple[int, ObjectTree, list[str]]:
    """The bytes of every object of `msg` (content-addressed: an object twice in it travels once),
    its object tree and the objects' ids."""
    objects = get_all_nested_objects(msg)
    return sum(len(o.deflate()) for o in objects.values()), get_object_tree(msg), list(objects)


def _head(msg: Message) -> ProtoMessage:
    """`msg` as a Fleet request names it: its metadata (its id set, as when it is pushed) and an
    empty content, or its error. Built from a copy: Flower's `remove_content_from_message` resets
    `delivered_at` on the message's own metadata, which in an in-process runtime is the
    SuperLink's record of the call, so the call was handed out a second time."""
    error = msg.has_error()
    head = ProtoMessage(
        metadata=metadata_to_proto(msg.metadata),
        content=None if error else recorddict_to_proto(RecordDict()),
        error=error_to_proto(msg.error) if error else None,
    )
    head.metadata.message_id = head.metadata.message_id or msg.object_id
    return head


def fleet_bytes(call: Message, reply: Message) -> tuple[int, int]:
    """The bytes down and up that Flower's Fleet API moves between a SuperNode and the SuperLink
    for `call` and its `reply`, as Flower's own count of a run records them
    (`flwr/superlink/servicer/fleet/fleet_handlers.py`, shown by `flwr ls` as `network-traffic`):
    down (the SuperLink's outbound) the PullMessages response that hands the node the call, every
    object of the call pulled (the message, its RecordDict, records, arrays and their chunks) and
    the PushMessages response that asks for the reply's objects; up (inbound) the PullMessages
    request, the PushMessages request with the reply's head and tree, and every object of the
    reply pushed. Inline weights are most of it; the rest is the call's record, the reply's
    metrics and the framing. The sizes are those of the same protobuf messages built here."""
    with no_object_id_recompute():  # each object's id (a sha256 of its bytes) once, not per parent
        node = Node(node_id=call.metadata.dst_node_id)
        call_bytes, call_tree, _ = _objects(call)
        reply_bytes, reply_tree, reply_ids = _objects(reply)
        pulled = PullMessagesResponse(messages_list=[_head(call)], message_object_trees=[call_tree])
        head = _head(reply)
        pushed = PushMessagesRequest(
            node=node, messages_list=[head], message_object_trees=[reply_tree], clientapp_runtime_list=[1.0]
        )
        asked = PushMessagesResponse(
            reconnect=Reconnect(reconnect=5),
            results={head.metadata.message_id: 0},
            objects_to_push=reply_ids,
            session_id=str(UUID(int=0)),  # a uuid4's length
        )
        down = pulled.ByteSize() + call_bytes + asked.ByteSize()
        return down, PullMessagesRequest(node=node).ByteSize() + pushed.ByteSize() + reply_bytes


def count_reply(call: Message, reply: Message, record: str = "metrics") -> Message:
    """`reply` with the call's and its own `fleet_bytes` in its metric record `record`, measured
    while both keys held 0.0 (doubles: the same size as the counts that replace them)."""
    metrics = reply.content.metric_records[record]
    if metrics.get(MESSAGE_DOWN) != 0.0 or metrics.get(MESSAGE_UP) != 0.0:
        raise ValueError(f"count_reply: the reply's {record!r} record needs {MESSAGE_DOWN} = {MESSAGE_UP} = 0.0")
    metrics[MESSAGE_DOWN], metrics[MESSAGE_UP] = map(float, fleet_bytes(call, reply))
    return reply
