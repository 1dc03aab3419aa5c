"""Who may talk to the daemon (see docs/security.md): CurveZMQ for non-loopback binds (the
daemon's key pair, and the directory of worker public keys whose file stems are the worker ids
they may use), the control secret and the control socket's mode, the modes of the state
directory and of secret files, and one rate-limited record of every refusal."""

from __future__ import annotations

import contextlib
import grp
import hashlib
import os
import secrets
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import structlog
import zmq
import zmq.auth
from prometheus_client import Counter
from zmq.auth.asyncio import AsyncioAuthenticator

from dynaresized.control import control_secret_file

log = structlog.get_logger("dynaresized.security")

STATE_DIR_MODE = 0o750  # the daemon's user writes; control_group (or the user's group) reads the log
_REFUSAL_LOG_EVERY_S = 10.0


class SecurityError(Exception):
    pass


def create_file(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Create `path` with `mode` from its first byte: os.open sets the mode as it creates the
    file, where open() then chmod leaves it readable under the umask in between (fchmod: the
    umask could only narrow it). An existing file is refused, never overwritten."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode & 0o600)
    try:
        os.fchmod(fd, mode)
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def keygen(directory: str | Path, name: str) -> tuple[Path, Path]:
    """Write `<name>.key` (public) and `<name>.key_secret` (secret, mode 0600) into directory.
    Refuses to overwrite an existing pair (FileExistsError)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    public_key, secret_key = zmq.curve_keypair()
    public, secret = directory / f"{name}.key", directory / f"{name}.key_secret"
    for path in (public, secret):
        if path.exists():
            raise FileExistsError(f"{path} exists: move it aside to write a new key pair")
    create_file(secret, _certificate("secret", public_key, secret_key))
    create_file(public, _certificate("public", public_key), 0o644)
    return public, secret


def _certificate(kind: str, public_key: bytes, secret_key: bytes | None = None) -> bytes:
    """A ZeroMQ certificate in the format zmq.auth.load_certificate reads (pyzmq's own writer
    opens the file under the umask)."""
    lines = [f"#   ZeroMQ CURVE {kind} certificate, written by dynaresized keygen", "", "metadata", "curve",
             f'    public-key = "{public_key.decode()}"']
    if secret_key is not None:
        lines.append(f'    secret-key = "{secret_key.decode()}"')
    return ("\n".join(lines) + "\n").encode()


def make_state_dir(path: Path, group: str = "") -> None:
    """Create the state directory 0750 whoever starts the daemon (a umask of 022 would leave it
    0755), and tighten one this user owns that is wider. With a control group, that group owns
    it, setgid so that the log files created in it are the group's too: its members reach the
    control socket and read the event log, others reach nothing."""
    path.mkdir(parents=True, exist_ok=True, mode=STATE_DIR_MODE)
    mode = STATE_DIR_MODE | (stat.S_ISGID if group else 0)
    st = path.stat()
    if group:
        os.chown(path, -1, grp.getgrnam(group).gr_gid)
    if st.st_uid == os.geteuid() and stat.S_IMODE(st.st_mode) != mode:
        os.chmod(path, mode)


def secret_digest(secret: str) -> str:
    """What the log keeps of a worker process's hello secret: its SHA-256 in hex ("" for none).
    The secret is 128 random bits or more, so the digest tells a log reader nothing it can use."""
    return hashlib.sha256(secret.encode()).hexdigest() if secret else ""


def load_control_secret(state_dir: Path) -> bytes:
    """The secret the CLI must present to change anything: read from `control.secret` in the
    state directory, created 0600 with a fresh random value on the first start."""
    path = control_secret_file(state_dir)
    if not path.exists():
        create_file(path, secrets.token_hex(32).encode() + b"\n")
    secret = path.read_bytes().strip()
    if not secret:
        raise SecurityError(f"{path} is empty: delete it and the daemon writes a new one")
    return secret


@contextlib.contextmanager
def owner_only_umask() -> Iterator[None]:
    """Around binding the control socket: bind(2) creates an ipc:// socket file under the umask,
    so with this one it is 0600 from the start, wherever it is configured to be. The umask is
    the process's, and start-up runs no other thread that creates files meanwhile."""
    old = os.umask(0o177)
    try:
        yield
    finally:
        os.umask(old)


def restrict_ipc_socket(endpoint: str, group: str = "") -> None:
    """Give a bound ipc:// socket mode 0600, or 0660 owned by `group`: connecting needs write
    permission on the socket file."""
    if not endpoint.startswith("ipc://"):
        return
    path = endpoint[len("ipc://"):]
    if group:
        os.chown(path, -1, grp.getgrnam(group).gr_gid)
    os.chmod(path, 0o660 if group else 0o600)


class Refusals:
    """Counts every refusal (`dynaresized_security_refusals_total{kind}`) and logs it, at most one
    line per kind every 10 seconds with the number left unsaid, so a flood of probes can
    neither hide in silence nor fill the journal."""

    def __init__(self, counter: Counter, clock: Callable[[], float] = time.monotonic) -> None:
        self.counter = counter
        self.clock = clock
        self._last: dict[str, float] = {}
        self._unsaid: dict[str, int] = {}

    def record(self, kind: str, message: str, **fields: object) -> None:
        self.counter.labels(kind).inc()
        now = self.clock()
        last = self._last.get(kind)
        if last is not None and now - last < _REFUSAL_LOG_EVERY_S:
            self._unsaid[kind] = self._unsaid.get(kind, 0) + 1
            return
        self._last[kind] = now
        unsaid = self._unsaid.pop(kind, 0)
        log.warning(message, refusal=kind, **({"not_logged_since_last": unsaid} if unsaid else {}), **fields)


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
    if not Path(secret_key_file).is_file():
        # zmq.auth calls a missing file an "Invalid certificate file": say what is wrong, and the fix
        missing = "is a directory" if Path(secret_key_file).is_dir() else "does not exist"
        raise SecurityError(f"server_secret_key {secret_key_file} {missing}: name the daemon's .key_secret file "
                            "(`dynaresized keygen daemon --dir DIR` writes DIR/daemon.key_secret)")
    try:
        public, secret = zmq.auth.load_certificate(secret_key_file)
    except (OSError, ValueError) as exc:
        raise SecurityError(f"cannot read server_secret_key {secret_key_file}: {exc}") from None
    if secret is None:
        raise SecurityError(f"{secret_key_file} holds no secret key (use the .key_secret file)")
    return public, secret, load_authorized(authorized_keys_dir)


class _Credentials:
    def __init__(self, keys: dict[bytes, str], refusals: Refusals) -> None:
        self.keys = keys
        self.refusals = refusals

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.keys:
            return True
        self.refusals.record("unknown_key", "refused a CURVE handshake: key not in authorized_keys_dir",
                             key=key.decode(errors="replace"))
        return False


class CurveServer:
    """Turns CURVE on for server sockets; `worker_of(frame)` names an authenticated peer."""

    def __init__(self, context: zmq.asyncio.Context, secret_key_file: str, authorized_keys_dir: str,
                 refusals: Refusals) -> None:
        self.public, self.secret, self.keys = load_server_keys(secret_key_file, authorized_keys_dir)
        self.auth = AsyncioAuthenticator(context)
        self.auth.start()
        self.auth.configure_curve_callback(domain="*", credentials_provider=_Credentials(self.keys, refusals))

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
