"""STUN binding (RFC 8489) on aioice's ``stun`` codec: no event loop, no sockets.

The relay answers a binding request with the requester's reflexive address in
XOR-MAPPED-ADDRESS; a node uses that to learn how the outside sees it.
"""

from __future__ import annotations

from aioice import stun


class StunError(Exception):
    """A datagram that is not the STUN message we can use."""


def _parse(data: bytes) -> stun.Message:
    try:
        return stun.parse_message(data)
    except Exception as exc:  # aioice raises ValueError, struct.error, ...: all mean "not STUN"
        raise StunError(f"not a STUN message: {exc.__class__.__name__}") from exc


def binding_request() -> tuple[bytes, bytes]:
    """A new binding request: ``(transaction_id, datagram)``."""
    msg = stun.Message(message_method=stun.Method.BINDING, message_class=stun.Class.REQUEST)
    return msg.transaction_id, bytes(msg)


def binding_response(request: bytes, addr: tuple[str, int]) -> bytes:
    """The answer to a binding request received from ``addr``; StunError for anything else."""
    msg = _parse(request)
    if msg.message_method != stun.Method.BINDING or msg.message_class != stun.Class.REQUEST:
        raise StunError(f"not a binding request ({msg.message_method.name} {msg.message_class.name})")
    response = stun.Message(
        message_method=stun.Method.BINDING,
        message_class=stun.Class.RESPONSE,
        transaction_id=msg.transaction_id,
        attributes={"XOR-MAPPED-ADDRESS": (addr[0], addr[1])},
    )
    response.add_fingerprint()
    return bytes(response)


def parse_binding_response(data: bytes, transaction_id: bytes) -> tuple[str, int]:
    """The reflexive ``(ip, port)`` in a response to our request ``transaction_id``."""
    msg = _parse(data)
    if msg.transaction_id != transaction_id:
        raise StunError("response to another transaction")
    if msg.message_method != stun.Method.BINDING or msg.message_class != stun.Class.RESPONSE:
        raise StunError(f"not a binding response ({msg.message_method.name} {msg.message_class.name})")
    mapped = msg.attributes.get("XOR-MAPPED-ADDRESS") or msg.attributes.get("MAPPED-ADDRESS")
    if mapped is None:
        raise StunError("binding response without a mapped address")
    return mapped[0], mapped[1]
