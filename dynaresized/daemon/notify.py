"""The systemd notify protocol (sd_notify), spoken directly over NOTIFY_SOCKET.

READY=1 after replay and bind, WATCHDOG=1 from the reactor loop, STOPPING=1 on drain,
RELOADING=1 while SIGHUP re-reads the configuration (READY=1 again when done), STATUS= for
`systemctl status`. Without NOTIFY_SOCKET every call is a no-op.
"""

from __future__ import annotations

import os
import socket
import time


class Notifier:
    def __init__(self, address: str | None = None) -> None:
        address = address if address is not None else os.environ.get("NOTIFY_SOCKET", "")
        self._sock: socket.socket | None = None
        self._address: str | bytes = ""
        if address:
            # A leading '@' is an abstract-namespace socket (Linux).
            self._address = "\0" + address[1:] if address.startswith("@") else address
            self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        usec = os.environ.get("WATCHDOG_USEC", "")
        pid = os.environ.get("WATCHDOG_PID", "")
        watched = bool(usec) and (not pid or pid == str(os.getpid()))
        self.watchdog_interval_s: float | None = int(usec) / 1e6 / 2 if watched else None

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def send(self, *fields: str) -> None:
        if self._sock is None:
            return
        self._sock.sendto("\n".join(fields).encode(), self._address)

    def ready(self, status: str = "") -> None:
        self.send("READY=1", *( [f"STATUS={status}"] if status else []), f"MAINPID={os.getpid()}")

    def reloading(self) -> None:
        # MONOTONIC_USEC lets systemd (>= 253) tell this reload from an earlier one.
        self.send("RELOADING=1", f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")

    def watchdog(self) -> None:
        self.send("WATCHDOG=1")

    def stopping(self, status: str = "") -> None:
        self.send("STOPPING=1", *([f"STATUS={status}"] if status else []))

    def status(self, text: str) -> None:
        self.send(f"STATUS={text}")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
