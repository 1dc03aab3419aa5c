"""Separate network hosts on one Linux machine: network namespaces joined by a bridge, for
running the daemon and its workers as they run on a cluster (CurveZMQ over TCP between hosts)
and for cutting the network between them. Needs root (`ip netns`).

    with Hosts(3) as net:                 # host 0 and hosts 1, 2; a switch namespace between them
        net.popen(0, [sys.executable, "-m", "dynaresized.cli", "serve", ...])
        net.cut(1)                        # host 1 off the switch: a full partition, both ways
        net.heal(1)
        net.block(1, 0)                   # one way: nothing host 1 sends to host 0 leaves host 1
        net.loss(2, 0.2)                  # 20% of host 2's packets dropped, each way (needs nft)

Topology: every host is a namespace with loopback and one veth whose peer sits in a "switch"
namespace on a bridge; addresses are 10.77.0.(i+1)/24 on the veths. Nothing is added to the
machine's own namespace, so traffic goes only between these namespaces (and each one's own
loopback); deleting a namespace deletes its veths. Partitions are links taken down (the switch
side of a host's veth: silent, both ways) and blackhole routes (one way: the sender's packets to
that address are discarded); loss is an nftables rule (`numgen random`) in the host's namespace,
where `nft` is installed (Debian: `apt-get install nftables`); delay comes from `Relay`, a
userspace TCP relay (this kernel has no `netem`).

Everything made is removed on exit, on an exception, on SIGTERM/SIGINT/SIGHUP (turned into an
exception that unwinds the `with`) and at interpreter exit (atexit); a harness killed with
SIGKILL leaves namespaces named `dzh<pid>-*`, which the next `Hosts` removes (`sweep`) once that
pid is gone.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

SUBNET = "10.77.0"
PREFIX = "dzh"


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def nft_available() -> bool:
    return shutil.which("nft") is not None


def sweep() -> list[str]:
    """Remove the namespaces of harnesses whose process is gone (one killed with SIGKILL)."""
    removed = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not name.startswith(PREFIX) or "-" not in name:
            continue
        pid = name[len(PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            _ip("netns", "del", name, check=False)
            removed.append(name)
    return removed


class Hosts:
    """N hosts (network namespaces) on a bridge. Use as a context manager."""

    _live: list[Hosts] = []
    _handlers_installed = False

    def __init__(self, n: int, tag: str = "") -> None:
        if n < 1:
            raise ValueError("at least one host")
        self.n = n
        self.base = f"{PREFIX}{os.getpid()}-{tag}" if tag else f"{PREFIX}{os.getpid()}"
        self.switch = f"{self.base}-sw"
        self.names = [f"{self.base}-h{i}" for i in range(n)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(n)]
        self.procs: list[subprocess.Popen[bytes]] = []
        self.made: list[str] = []  # namespaces created, in order
        self.closed = False

    # -- setup and teardown
    def __enter__(self) -> Hosts:
        try:
            self.open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def open(self) -> None:
        if os.geteuid() != 0:
            raise PermissionError("network namespaces need root")
        sweep()
        Hosts._live.append(self)
        Hosts._install_handlers()
        self._netns_add(self.switch)
        sw = ["-n", self.switch]
        _ip(*sw, "link", "add", "br0", "type", "bridge")
        _ip(*sw, "link", "set", "br0", "up")
        for i, name in enumerate(self.names):
            self._netns_add(name)
            # the pair is born in the host's namespace and its peer moved to the switch: nothing
            # ever appears in the machine's own namespace
            _ip("-n", name, "link", "add", "eth0", "type", "veth", "peer", "name", f"p{i}", "netns", self.switch)
            _ip("-n", name, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0")
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", name, "link", "set", "eth0", "up")
            _ip(*sw, "link", "set", f"p{i}", "master", "br0")
            _ip(*sw, "link", "set", f"p{i}", "up")

    def _netns_add(self, name: str) -> None:
        _ip("netns", "add", name)
        self.made.append(name)

    def close(self) -> None:
        """Stop every process started in the hosts and delete every namespace made. Idempotent."""
        if self.closed:
            return
        self.closed = True
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        for name in reversed(self.made):
            _ip("netns", "del", name, check=False)
        self.made.clear()
        with contextlib.suppress(ValueError):
            Hosts._live.remove(self)

    @classmethod
    def _install_handlers(cls) -> None:
        if cls._handlers_installed or threading.current_thread() is not threading.main_thread():
            return
        cls._handlers_installed = True
        atexit.register(cls._close_all)
        for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
            previous = signal.getsignal(sig)
            if previous not in (signal.SIG_DFL, signal.default_int_handler, None):
                continue  # someone else's handler: theirs stands, atexit still cleans up

            def handler(signum: int, frame: Any) -> None:
                # unwind: `with` blocks and finally clauses run, and close() with them
                raise SystemExit(128 + signum)

            signal.signal(sig, handler)

    @classmethod
    def _close_all(cls) -> None:
        for hosts in list(cls._live):
            hosts.close()

    # -- using the hosts
    def exec_argv(self, i: int, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.names[i], *argv]

    def popen(self, i: int, argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
        """Start `argv` on host i (stopped by close() if still running)."""
        proc = subprocess.Popen(self.exec_argv(i, argv), **kwargs)
        self.procs.append(proc)
        return proc

    def run(self, i: int, argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.exec_argv(i, argv), capture_output=True, text=True, **kwargs)

    # -- faults
    def cut(self, i: int) -> None:
        """Host i off the switch: every packet to or from it is lost, silently, both ways."""
        _ip("-n", self.switch, "link", "set", f"p{i}", "down")

    def heal(self, i: int) -> None:
        """Undo every fault on host i: its link up, its blackholes and its loss rule gone."""
        _ip("-n", self.switch, "link", "set", f"p{i}", "up")
        for j in range(self.n):
            self.unblock(i, j)
            self.unblock(j, i)
        self.loss(i, 0.0)

    def block(self, src: int, dst: int) -> None:
        """One way: what host `src` sends to host `dst` is discarded at `src` (a blackhole
        route); what `dst` sends to `src` still arrives."""
        _ip("-n", self.names[src], "route", "replace", "blackhole", f"{self.addresses[dst]}/32")

    def unblock(self, src: int, dst: int) -> None:
        _ip("-n", self.names[src], "route", "del", "blackhole", f"{self.addresses[dst]}/32", check=False)

    def loss(self, i: int, fraction: float) -> None:
        """Drop `fraction` of the packets host i sends and receives (0 removes the rule)."""
        ns = self.names[i]
        if fraction <= 0:
            if nft_available():
                subprocess.run(["ip", "netns", "exec", ns, "nft", "delete", "table", "inet", "dzloss"],
                               capture_output=True)
            return
        if not nft_available():
            raise RuntimeError("packet loss needs nftables (`nft`): apt-get install nftables")
        pct = max(1, min(99, round(fraction * 100)))
        rules = (f"table inet dzloss {{\n"
                 f" chain in {{ type filter hook input priority 0; numgen random mod 100 < {pct} drop; }}\n"
                 f" chain out {{ type filter hook output priority 0; numgen random mod 100 < {pct} drop; }}\n}}\n")
        subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=rules, text=True, check=True,
                       capture_output=True)


# -- delay: a userspace TCP relay ------------------------------------------------------------------


class Relay:
    """A TCP relay (run inside a host with `python benchmarks/hosts.py relay ...`): accepts on
    LISTEN, connects each client to TARGET, and forwards bytes both ways, each chunk held for the
    delay in seconds that the file CONTROL says when the chunk arrives (missing or empty: 0).
    Order is kept per direction; nothing is dropped."""

    def __init__(self, listen: tuple[str, int], target: tuple[str, int], control: Path) -> None:
        self.listen, self.target, self.control = listen, target, control
        self.delay = 0.0

    def _read_delay(self) -> None:
        try:
            self.delay = float(self.control.read_text().strip() or 0)
        except (OSError, ValueError):
            self.delay = 0.0

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def send() -> None:
            while True:
                due, data = await queue.get()
                if not data:
                    break
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                writer.write(data)
                await writer.drain()

        sender = asyncio.create_task(send())
        try:
            while data := await reader.read(65536):
                await queue.put((time.monotonic() + self.delay, data))
        except (ConnectionError, OSError):
            pass
        await queue.put((0.0, b""))
        with contextlib.suppress(ConnectionError, OSError):
            await sender
        writer.close()

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True)

    async def serve(self) -> None:
        server = await asyncio.start_server(self._client, *self.listen)
        async with server:
            while True:
                self._read_delay()
                await asyncio.sleep(0.05)


def main(argv: list[str]) -> int:
    if argv[:1] == ["relay"] and len(argv) == 6:
        _, lhost, lport, thost, tport, control = argv
        asyncio.run(Relay((lhost, int(lport)), (thost, int(tport)), Path(control)).serve())
        return 0
    if argv[:1] == ["sweep"]:
        print("\n".join(sweep()))
        return 0
    print("usage: hosts.py relay LISTEN_HOST LISTEN_PORT TARGET_HOST TARGET_PORT CONTROL_FILE | sweep",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
