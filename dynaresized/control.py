"""The operator's side of the daemon's control endpoint: one request, one reply."""

from __future__ import annotations

import msgspec

from dynaresized import wire


def control_request(endpoint: str, request: msgspec.Struct, timeout_s: float = 5.0) -> wire.ControlReply:
    """Send one request to the daemon's control endpoint and wait for its reply."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(wire.encode(request))
        if not sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no answer from the daemon's control endpoint {endpoint} within {timeout_s:g}s "
                               "(is it running? `systemctl status dynaresized`)")
        reply = wire.reply_decoder().decode(sock.recv())
    finally:
        sock.close()
        ctx.term()
    if isinstance(reply, wire.Error):
        raise RuntimeError(f"daemon refused the request: {reply.message}")
    return reply
