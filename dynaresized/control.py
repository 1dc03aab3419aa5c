"""The operator's side of the daemon's control endpoint: one request, one reply.

A request travels as two frames, the control secret and the request. The daemon acts on
pause, resume, resize and drain only with the secret, which it keeps in a 0600 file in its
state directory (`control_secret_file`): only the daemon's user and root can read it, so only
they drive the daemon, whoever else can reach the endpoint. `status` needs no secret.
"""

from __future__ import annotations

import socket
from pathlib import Path
from urllib.parse import urlparse

import msgspec

from dynaresized import wire

CONTROL_SECRET_FILE = "control.secret"


def control_secret_file(state_dir: str | Path) -> Path:
    return Path(state_dir) / CONTROL_SECRET_FILE


def read_control_secret(state_dir: str | Path) -> bytes:
    """The daemon's control secret, or b"" for a user who may not read it (or no daemon has
    run with this state directory): the daemon then answers only `status`."""
    try:
        return control_secret_file(state_dir).read_bytes().strip()
    except (FileNotFoundError, PermissionError, NotADirectoryError):
        return b""


def control_request(endpoint: str, request: msgspec.Struct, timeout_s: float = 5.0, *,
                    secret: bytes = b"") -> wire.ControlReply:
    """Send one request to the daemon's control endpoint and wait for its reply (TimeoutError
    when none comes within `timeout_s`: callers waiting for a daemon to start retry on it)."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send_multipart([secret, wire.encode(request)])
        if not sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no answer from the daemon's control endpoint {endpoint} within {timeout_s:g}s "
                               "(is it running, and may this user reach it? `systemctl status dynaresized`)")
        reply = wire.reply_decoder().decode(sock.recv())
    finally:
        sock.close()
        ctx.term()
    if isinstance(reply, wire.Error):
        raise RuntimeError(f"daemon refused the request: {reply.message}")
    return reply


def ensure_listening(endpoint: str, timeout_s: float = 2.0) -> None:
    """Raise ConnectionRefusedError at once when nothing listens on `endpoint`.

    A ZeroMQ connect never fails: it retries in the background, so an operator asking a daemon
    that is down would wait out the whole timeout. One plain connect tells "nothing listens"
    apart; anything but a refusal (a slow network, a firewall) is left to the ZeroMQ timeout."""
    url = urlparse(endpoint)
    if url.scheme == "tcp" and url.hostname and url.port:
        family, address = socket.AF_INET6 if ":" in url.hostname else socket.AF_INET, (url.hostname, url.port)
    elif url.scheme == "ipc":
        family, address = socket.AF_UNIX, endpoint[len("ipc://"):]
    else:
        return
    probe = socket.socket(family, socket.SOCK_STREAM)
    probe.settimeout(min(timeout_s, 2.0))
    try:
        probe.connect(address)
    except (ConnectionRefusedError, FileNotFoundError):
        raise ConnectionRefusedError(f"nothing listens on the daemon's control endpoint {endpoint} "
                                     "(is it running? `systemctl status dynaresized`)") from None
    except OSError:
        pass
    finally:
        probe.close()
