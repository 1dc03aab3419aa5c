"""The rendezvous store of a training job, hosted by a process that outlives the trainers.

Every process group, membership change, heartbeat and recovery decision of the torch
backend goes through one `torch.distributed.TCPStore`. If the process hosting it dies, no
new group can be created, so it is never an arbitrary trainer rank: it is a `StoreHost`
run by the launcher or the daemon side (`python -m dynaresized.backends.torch.store`), or
the torchrun agent's store (`TORCHELASTIC_USE_AGENT_STORE=True`).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from datetime import timedelta

import msgspec
import torch.distributed as dist

DEFAULT_PREFIX = "dr"


class StoreAddress(msgspec.Struct, frozen=True):
    """Where the job's store listens, and the key prefix this job's keys live under."""

    host: str
    port: int
    prefix: str = DEFAULT_PREFIX

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"

    @staticmethod
    def parse(text: str, prefix: str = DEFAULT_PREFIX) -> StoreAddress:
        host, sep, port = text.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"store address {text!r} is not host:port (e.g. 127.0.0.1:29500)")
        return StoreAddress(host=host, port=int(port), prefix=prefix)

    @staticmethod
    def from_env(environ: dict[str, str] | None = None) -> StoreAddress | None:
        """The torchrun agent's store (MASTER_ADDR/MASTER_PORT), if this process runs under an
        agent that hosts it; our keys go under a prefix that cannot collide with torchrun's."""
        env = os.environ if environ is None else environ
        if env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() != "true":
            return None
        if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
            raise ValueError("TORCHELASTIC_USE_AGENT_STORE is set but MASTER_ADDR/MASTER_PORT are not")
        return StoreAddress(host=env["MASTER_ADDR"], port=int(env["MASTER_PORT"]), prefix=f"{DEFAULT_PREFIX}-elastic")


def connect_store(address: StoreAddress, timeout_s: float = 30.0) -> dist.TCPStore:
    """A client connection to the job's store. Each thread that talks to the store should
    use its own connection (`store.clone()`)."""
    return dist.TCPStore(address.host, address.port, is_master=False, timeout=timedelta(seconds=timeout_s),
                         use_libuv=True)


class StoreHost:
    """Hosts the job's TCPStore in this process until `close()`.

    `port=0` lets the kernel pick a free port (no race with other jobs or tests); read it
    back from `address`.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, prefix: str = DEFAULT_PREFIX,
                 timeout_s: float = 30.0) -> None:
        self._store: dist.TCPStore | None = dist.TCPStore(
            host, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s), use_libuv=True)
        self.address = StoreAddress(host=host, port=self._store.port, prefix=prefix)

    @property
    def store(self) -> dist.TCPStore:
        if self._store is None:
            raise RuntimeError(f"the store host at {self.address} is closed")
        return self._store

    def close(self) -> None:
        # Dropping the master object stops its server; clients see connection errors after.
        self._store = None

    def __enter__(self) -> StoreHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: list[str] | None = None) -> int:
    """Run a dedicated store host: prints `host:port` on one line, then serves until SIGTERM,
    SIGINT or the end of stdin (so a launcher that dies takes its store host with it)."""
    parser = argparse.ArgumentParser(prog="python -m dynaresized.backends.torch.store",
                                     description="Host the rendezvous TCPStore of a dynaresized torch job.")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port (printed on stdout)")
    parser.add_argument("--no-stdin-watch", action="store_true", help="keep serving when stdin closes")
    args = parser.parse_args(argv)
    host = StoreHost(args.host, args.port)
    print(host.address, flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    if not args.no_stdin_watch:
        def watch_stdin() -> None:
            sys.stdin.read()
            stop.set()
        threading.Thread(target=watch_stdin, name="stdin-watch", daemon=True).start()
    stop.wait()
    host.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
