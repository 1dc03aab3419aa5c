"""`dynaresized toy-cluster`: simulated devices attached to a daemon you run, to try the operator's
commands (status, resize, regroup, pause, resume, drain) without GPUs or systemd.

    dynaresized toy-cluster --write-config DIR   # DIR/config.toml: 8 simulated GPUs, the log in DIR/state
    dynaresized serve &                          # with DYNARESIZED_CONFIG=DIR/config.toml (or --config)
    dynaresized toy-cluster                      # attach them; returns once every worker is in

The devices are the profile's (`qwen3-8b-h20x8`: node0:gpu0..7, 6 training and 2 rollout at the
start), each an engine and a trainer worker over the real client, in one background process that
answers every op in the time the simulator's cost model gives it, `--speedup` times faster. They
run no RL loop, so the policy (`static` in the written config) sees no step and moves nothing:
only the operator does. The process leaves when the daemon stops (`dynaresized drain`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from dynaresized import wire
from dynaresized.control import control_request, ensure_listening
from dynaresized.daemon.config import CONFIG_ENV, ConfigError, config_path, control_endpoint_of, load_config
from dynaresized.domain import Pool

PROFILE = "qwen3-8b-h20x8"
LOG = "toy-cluster.log"


def add_parser(sub: Any) -> None:
    p = sub.add_parser("toy-cluster", help="attach simulated devices to a running daemon, to try the operator's "
                                           "commands (--write-config DIR first)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--write-config", metavar="DIR", help="write DIR/config.toml for the simulated devices and exit")
    p.add_argument("--config", help=f"the daemon's config (default ${CONFIG_ENV})")
    p.add_argument("--profile", default=PROFILE, help=f"built-in cluster profile (default {PROFILE})")
    p.add_argument("--speedup", type=float, default=100.0,
                   help="simulated seconds per real second for each op (default 100: a resize takes ~1 s)")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the daemon and the workers")
    p.set_defaults(run=run)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def config_text(directory: Path, profile: str) -> str:
    """A config for the profile's devices: loopback only, the log under `directory`, and the
    `static` policy, so that only the operator moves devices."""
    from dynaresized.sim.cluster import VirtualCluster

    cluster = VirtualCluster.builtin("longtail-drift", profile, steps=1)
    training = [d for d, p in zip(cluster.devices, cluster.initial_pools, strict=True) if p is Pool.TRAINING]
    return f"""# dynaresized toy-cluster: {len(cluster.devices)} simulated devices of the profile {profile}
[daemon]
state_dir = "{directory.absolute() / 'state'}"
worker_endpoint = "tcp://127.0.0.1:{_free_port()}"
metrics_port = 0
log_format = "console"

[cluster]
devices = {json.dumps(list(cluster.devices))}
training = {json.dumps(training)}

[policy]
name = "static"  # no step is reported: only the operator moves devices
"""


def run(args: argparse.Namespace) -> int:
    if args.write_config:
        directory = Path(args.write_config)
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / "config.toml"
        path.write_text(config_text(directory, args.profile))
        print(f"wrote {path}; next:\n  export {CONFIG_ENV}={path.absolute()}\n  dynaresized serve &\n"
              "  dynaresized toy-cluster")
        return 0
    path, found = config_path(args.config)
    if path is None:
        print(f"dynaresized: toy-cluster needs the daemon's config: --config FILE or {CONFIG_ENV}=FILE "
              "(`dynaresized toy-cluster --write-config DIR` writes one)", file=sys.stderr)
        return 6
    try:
        config = load_config(path)
    except ConfigError as exc:
        print(f"dynaresized: {exc} (from {found})", file=sys.stderr)
        return 6
    from dynaresized.sim.cluster import VirtualCluster

    devices = list(config.cluster.devices)
    known = VirtualCluster.builtin("longtail-drift", args.profile, steps=1).devices
    if unknown := [d for d in devices if d not in known]:
        print(f"dynaresized: {path}: {', '.join(unknown)} are not devices of the profile {args.profile} "
              f"({', '.join(known)}); `dynaresized toy-cluster --write-config DIR` writes a config that lists them",
              file=sys.stderr)
        return 6
    control = control_endpoint_of(config.daemon)
    if _wait(lambda: _status(control), args.timeout) is None:
        print(f"dynaresized: no daemon answers on {control} (from {found}) within {args.timeout:g}s; "
              "start it first: `dynaresized serve &`", file=sys.stderr)
        return 3
    log = Path(path).absolute().parent / LOG
    cmd = [sys.executable, "-m", "dynaresized.backends.sim", "--endpoint", config.daemon.worker_endpoint,
           "--device", ",".join(devices), "--profile", args.profile, "--speedup", f"{args.speedup:g}",
           "--steps", "1", "--leave-with", control]
    with log.open("ab") as out:  # its own session: it outlives this command, and a Ctrl-C here
        host = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})

    def all_in() -> bool | None:
        data = _status(control)
        live = {w["id"] for w in (data or {}).get("workers", []) if w["status"] == "live"}
        return len(live) >= 2 * len(devices) or None

    if _wait(all_in, args.timeout, host) is None:
        print(f"dynaresized: the simulated devices did not all attach within {args.timeout:g}s; their log: {log}",
              file=sys.stderr)
        if host.poll() is None:
            host.terminate()
        return 1
    print(f"{len(devices)} simulated devices attached to {config.daemon.worker_endpoint} (an engine and a trainer "
          f"each, pid {host.pid}, log {log}); they leave when the daemon stops")
    return 0


def _status(control: str) -> dict[str, Any] | None:
    try:
        ensure_listening(control, 1.0)
        return control_request(control, wire.StatusRequest(), 1.0).data
    except (ConnectionRefusedError, TimeoutError, RuntimeError):
        return None


def _wait(ready: Any, timeout_s: float, process: subprocess.Popen[bytes] | None = None) -> Any:
    """`ready()`'s first answer that is not None within `timeout_s`, else None (also as soon as
    `process`, if given, has exited)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (answer := ready()) is not None:
            return answer
        if process is not None and process.poll() is not None:
            return None
        time.sleep(0.2)
    return None
