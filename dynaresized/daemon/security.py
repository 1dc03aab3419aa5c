"""CurveZMQ for non-loopback binds: the daemon's key pair, and the directory of worker
public keys whose file stems are the worker ids they may use (see docs/security.md)."""

from __future__ import annotations

import os
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator


class SecurityError(Exception):
    pass


def keygen(directory: str | Path, name: str) -> tuple[Path, Path]:
    """Write `<name>.key` (public) and `<name>.key_secret` (secret, mode 0600) into directory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(str(directory), name)
    os.chmod(secret, 0o600)
    return Path(public), Path(secret)


def load_authorized(directory: str | Path) -> dict[bytes, str]:
    """Map each authorized worker public key (z85) to the worker id it may use."""
    directory = Path(directory)
    if not directory.is_dir():
        raise SecurityError(f"authorized_keys_dir {directory} is not a directory")
    keys: dict[bytes, str] = {}
    for path in sorted(directory.glob("*.key")):
        public, _ = zmq.auth.load_certificate(str(path))
        keys[public] = path.stem
    if not keys:
        raise SecurityError(f"authorized_keys_dir {directory} holds no *.key public key files")
    return keys


def load_server_keys(secret_key_file: str, authorized_keys_dir: str) -> tuple[bytes, bytes, dict[bytes, str]]:
    """The daemon's public and secret key, and the authorized worker keys (see load_authorized)."""
    try:
        public, secret = zmq.auth.load_certificate(secret_key_file)
    except (OSError, ValueError) as exc:
        raise SecurityError(f"cannot read server_secret_key {secret_key_file}: {exc}") from None
    if secret is None:
        raise SecurityError(f"{secret_key_file} holds no secret key (use the .key_secret file)")
    return public, secret, load_authorized(authorized_keys_dir)


class _Credentials:
    def __init__(self, keys: dict[bytes, str]) -> None:
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


class CurveServer:
    """Turns CURVE on for server sockets; `worker_of(frame)` names an authenticated peer."""

    def __init__(self, context: zmq.asyncio.Context, secret_key_file: str, authorized_keys_dir: str) -> None:
        self.public, self.secret, self.keys = load_server_keys(secret_key_file, authorized_keys_dir)
        self.auth = AsyncioAuthenticator(context)
        self.auth.start()
        self.auth.configure_curve_callback(domain="*", credentials_provider=_Credentials(self.keys))

    def apply(self, socket: zmq.Socket) -> None:
        socket.curve_secretkey = self.secret
        socket.curve_publickey = self.public
        socket.curve_server = True

    def worker_of(self, frame: zmq.Frame) -> str | None:
        user = frame.get("User-Id")
        if not user:
            return None
        return self.keys.get(user.encode() if isinstance(user, str) else user)

    def stop(self) -> None:
        self.auth.stop()
