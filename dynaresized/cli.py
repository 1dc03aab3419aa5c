"""`dynaresized`: the command line for the daemon and its operators.

Exit codes follow the LSB/systemd conventions: 0 success, 1 failure, 2 bad usage,
3 the daemon is not running (status), 6 not configured (bad or missing configuration).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from dynaresized import __version__, wire
from dynaresized.control import control_request, ensure_listening, read_control_secret
from dynaresized.daemon.config import CONFIG_ENV, DEFAULT_CONFIG, config_path

if TYPE_CHECKING:
    from dynaresized.store import LogStart

EXIT_OK, EXIT_FAIL, EXIT_USAGE, EXIT_NOT_RUNNING, EXIT_NOT_CONFIGURED = 0, 1, 2, 3, 6
ELSEWHERE = f"point the CLI at another daemon with --config FILE or {CONFIG_ENV}=FILE"


def _load(path: str, found: str):  # type: ignore[no-untyped-def]
    """load_config, with where the path came from in its error when no --config named it."""
    from dynaresized.daemon.config import ConfigError, load_config

    try:
        return load_config(path)
    except ConfigError as exc:
        if found.startswith(CONFIG_ENV):
            raise ConfigError(f"{exc} (named by {CONFIG_ENV})") from None
        if found.startswith("the built-in"):  # nothing named, the default missing: say how to name one
            raise ConfigError(f"{exc} (no --config given and {CONFIG_ENV} unset: name the file with either)") \
                from None
        raise


def _config_for_daemon(named: str | None):  # type: ignore[no-untyped-def]
    """The config `serve` and `check-config` load (ConfigError when there is none), and its path."""
    path, found = config_path(named)
    return _load(path or DEFAULT_CONFIG, found), path or DEFAULT_CONFIG


def _config_for_client(named: str | None):  # type: ignore[no-untyped-def]
    """The config a client command reads endpoints from (see config_path), and where it came from."""
    from dynaresized.daemon.config import Config

    path, found = config_path(named)
    return (_load(path, found) if path else Config()), found


def _cmd_serve(args: argparse.Namespace) -> int:
    from dynaresized.daemon.config import ConfigError
    from dynaresized.daemon.logs import configure_logging
    from dynaresized.daemon.service import StartupError, run_daemon

    try:
        config, path = _config_for_daemon(args.config)
    except ConfigError as exc:
        print(f"dynaresized: {exc}", file=sys.stderr)
        return EXIT_NOT_CONFIGURED
    configure_logging(config.daemon.log_format, config.daemon.log_level)
    try:
        return run_daemon(config, path)
    except StartupError as exc:
        print(f"dynaresized: cannot start: {exc}", file=sys.stderr)
        return EXIT_NOT_CONFIGURED


def _control(args: argparse.Namespace, request: msgspec.Struct) -> wire.ControlReply | int:
    from dynaresized.daemon.config import ConfigError, control_endpoint_of

    try:
        config, found = _config_for_client(args.config)
    except ConfigError as exc:
        print(f"dynaresized: {exc}", file=sys.stderr)
        return EXIT_NOT_CONFIGURED
    daemon = config.daemon
    endpoint = args.control or control_endpoint_of(daemon)
    try:
        ensure_listening(endpoint, args.timeout)
        return control_request(endpoint, request, args.timeout, secret=read_control_secret(daemon.state_dir))
    except (TimeoutError, ConnectionRefusedError) as exc:
        where = "--control" if args.control else found
        print(f"dynaresized: {exc}\n  the endpoint is from {where}; {ELSEWHERE} (or --control ENDPOINT)",
              file=sys.stderr)
        return EXIT_NOT_RUNNING
    except RuntimeError as exc:
        print(f"dynaresized: {exc}", file=sys.stderr)
        return EXIT_FAIL


def render_status(data: dict[str, Any]) -> str:
    split = data["split"]
    lines = [
        f"phase       {data['phase']}" + (" (paused)" if data["paused"] else "") +
        (" (stopping)" if data["stopping"] else ""),
        f"split       train {split['train']} : rollout {split['rollout']}",
        f"policy      {data['policy']}",
        f"last step   {'none' if data['last_step'] < 0 else data['last_step']}",
        f"resizes     {data['resizes']['started']} started: {data['resizes']['committed']} committed, "
        f"{data['resizes']['rolled_back']} rolled back, {data['resizes'].get('degraded', 0)} degraded, "
        f"{data['resizes'].get('in_flight', 0)} in flight",
    ]
    if data.get("engines"):
        regroups = data.get("regroups", {})
        lines.append("engines     " + "; ".join(f"TP-{len(g)} [{', '.join(g)}]" for g in data["engines"]) +
                     f" (the rest one device each; {regroups.get('committed', 0)} regroup(s) committed)")
    if data["degraded_reason"]:
        lines.append(f"DEGRADED    {data['degraded_reason']}")
    fl = data["in_flight"]
    if fl:
        if fl.get("reconciling"):
            lines.append(f"in flight   reconcile {fl['resize_id']} of {fl['reconciling']}; op {fl['op']}")
        else:
            lines.append(f"in flight   {fl['resize_id']} {fl['from']} -> {fl['to']} on {', '.join(fl['devices'])}; "
                         f"op {fl['op']}{' (rolling back)' if fl['rolling_back'] else ''}")
    lines.append("")
    outcome = _outcome_lines(data)  # idle figures and how the last resize did (docs/idle.md)
    lines.extend([*outcome, ""] if outcome else [])
    lines.append(f"{'DEVICE':<20} {'POOL':<28} {'IDLE':<9} WORKERS")
    from dynaresized.core.idle import percent

    idle = data.get("idle", {}).get("devices", {})
    by_device: dict[str, list[str]] = {}
    for w in data["workers"]:
        held = w.get("actual") or "?"
        if w.get("desired") and w.get("actual") and w["desired"] != w["actual"]:
            held += f"!={w['desired']}"  # the worker disagrees with the log: reconciling, or unconverged
        if w.get("unconverged"):
            held += " UNCONVERGED"
        for d in w["devices"]:
            by_device.setdefault(d, []).append(f"{w['id']}({w['kind']},{w['status']},{held})")
    for device, pool in data["devices"].items():
        ratio = percent(idle[device]["ratio"]) if device in idle else "unknown"
        lines.append(f"{device:<20} {pool:<28} {ratio:<9} {' '.join(by_device.get(device, [])) or '-'}")
    return "\n".join(lines)


def _outcome_lines(data: dict[str, Any]) -> list[str]:
    """Idle ratios per pool and how the last resize turned out (docs/idle.md)."""
    from dynaresized.core.idle import percent

    lines = []
    idle = data.get("idle")
    if idle:
        # Each pool has its own count: a step one pool's reports do not cover is unknown there only.
        parts = [f"{pool} {percent(t['ratio'])} (last step {percent(t['last_step_ratio'])})"
                 for pool, t in idle["pools"].items()]
        counts = [f"{pool} {t['steps']} step(s) accounted, {t['unknown_steps']} unknown"
                  for pool, t in idle["pools"].items()]
        lines.append(f"idle        {', '.join(parts)}; {'; '.join(counts)}")
    model = data.get("cost_model")
    if model:
        floor = f", latency floor {model['floor_s']:.1f}s" if model.get("floor_s") is not None else ""
        lines.append(f"cost model  {model['model'] or 'none'}{floor}: {model['why']}")
    outcome = data.get("outcome")
    if outcome:
        p = outcome["last_prediction"]
        if p:
            lines.append(f"prediction  {p['resize_id']}: step {p['predicted_step_s_after']:.1f}s predicted, "
                         f"{p['measured_step_s_after']:.1f}s measured, error {p['error_s']:+.1f}s")
        from dynaresized.explain import accuracy

        checked = [words for kind, a in (outcome.get("accuracy") or {}).items() if (words := accuracy(kind, a))]
        if checked:
            lines.append(f"accuracy    {'; '.join(checked)}")
        v = outcome["last_verdict"]
        if v:
            saved = "unknown" if v["saved_s"] is None else f"{v['saved_s']:+.1f}s"
            flag = "MADE THINGS WORSE" if v["verdict"] == "worse" else v["verdict"].replace("_", " ")
            undo = f"; undone: back to {v['undo_to']['train']}:{v['undo_to']['rollout']}" if v.get("undo_to") else ""
            lines.append(f"last resize {v['resize_id']} {flag}: saved {saved} over {v['steps']} step(s){undo}")
        m = outcome["measuring"]
        if m and m["committed"]:
            lines.append(f"measuring   {m['resize_id']}: {m['steps']} of {m['payback_steps']} step(s)")
        if outcome["payback_factor"] != 1.0:
            lines.append(f"payback     required payback raised x{outcome['payback_factor']:g} by past resizes")
    return lines


def _cmd_status(args: argparse.Namespace) -> int:
    reply = _control(args, wire.StatusRequest())
    if isinstance(reply, int):
        return reply
    if args.json:
        print(json.dumps(reply.data, indent=2, sort_keys=True))
    else:
        print(render_status(reply.data))
    return EXIT_OK


def _simple(request_of, counter: str = "") -> Any:  # type: ignore[no-untyped-def]
    """A command that sends one request and prints the answer; with `--wait` (resize, regroup:
    `counter` names the status count a commit raises), it then waits until the sequence it
    started has committed or rolled back, and says which."""
    def run(args: argparse.Namespace) -> int:
        before = _control(args, wire.StatusRequest()) if getattr(args, "wait", False) else None
        if isinstance(before, int):
            return before
        reply = _control(args, request_of(args))
        if isinstance(reply, int):
            return reply
        print(reply.message)
        if not reply.ok or before is None:
            return EXIT_OK if reply.ok else EXIT_FAIL
        return _wait_for_commit(args, counter, before.data[counter]["committed"])

    return run


def _wait_for_commit(args: argparse.Namespace, counter: str, committed_before: int) -> int:
    while True:
        time.sleep(0.2)
        status = _control(args, wire.StatusRequest())
        if isinstance(status, int):
            return status
        data = status.data
        if data["in_flight"] is None:
            break
    split = f"split train {data['split']['train']} : rollout {data['split']['rollout']}"
    if counter == "regroups":
        split += "; engines " + ("; ".join(f"TP-{len(g)} [{', '.join(g)}]" for g in data["engines"]) or
                                 "one device each")
    if data[counter]["committed"] > committed_before:
        print(f"committed: {split}")
        return EXIT_OK
    print(f"not committed (rolled back or degraded: `dynaresized status`): {split}")
    return EXIT_FAIL


def _cmd_events(args: argparse.Namespace) -> int:
    from dynaresized.core.facts import FACT_TYPES, StepObserved, decode_fact, fact_to_json

    FACT_TAGS = [cls.__struct_config__.tag for cls in FACT_TYPES]  # type: ignore[misc]
    from dynaresized.core.idle import idle_ratio
    from dynaresized.domain import Pool
    from dynaresized.daemon.config import ConfigError
    from dynaresized.daemon.service import EVENTS_FILE
    from dynaresized.explain import explain
    from dynaresized.store import CompactedError, CorruptLogError, open_recorder

    try:
        config, found = _config_for_client(None if args.state_dir else args.config)
    except ConfigError as exc:
        print(f"dynaresized: {exc}", file=sys.stderr)
        return EXIT_NOT_CONFIGURED
    state_dir, found = (args.state_dir, "--state-dir") if args.state_dir else (config.daemon.state_dir, found)
    types = set(args.type) if args.type else None
    if unknown := sorted((types or set()) - set(FACT_TAGS)):
        print(f"dynaresized: unknown event type(s) {', '.join(map(repr, unknown))}; the log records: "
              f"{', '.join(FACT_TAGS)}", file=sys.stderr)
        return EXIT_USAGE
    path = Path(state_dir) / EVENTS_FILE
    if not path.exists():
        print(f"dynaresized: no event log at {path} (has the daemon run with this state_dir?); the state_dir is "
              f"from {found}; {ELSEWHERE} (or --state-dir DIR)", file=sys.stderr)
        return EXIT_NOT_CONFIGURED
    as_json = args.json or not sys.stdout.isatty()
    try:
        recorder = open_recorder(path, read_only=True)
    except (CorruptLogError, ValueError, OSError) as exc:
        print(f"dynaresized: cannot read {path}: {exc}", file=sys.stderr)
        return EXIT_FAIL
    position = args.since
    try:
        while True:
            # Where the retained history starts, each time round: the daemon may have compacted
            # the facts this command had not read yet (a read it overtakes raises CompactedError).
            position = _history_from(recorder.log_start(), position)
            try:
                for stored in recorder.read_all(after_position=position, types=types):
                    position = stored.position
                    fact = decode_fact(stored.data)
                    if as_json:
                        body = json.loads(fact_to_json(fact))
                        body = {"position": stored.position, "recorded_at": stored.recorded_at, **body}
                        if isinstance(fact, StepObserved):
                            # derived, not stored: each pool's idle share of the step (docs/idle.md)
                            body["idle_ratio"] = {p.value: idle_ratio(fact.timing, p) for p in Pool}
                        sys.stdout.write(json.dumps(body) + "\n")
                    else:
                        stamp = time.strftime("%H:%M:%S", time.localtime(fact.at))
                        sys.stdout.write(f"{stored.position:>8} {stamp} {stored.type:<20} {explain(fact)}\n")
            except CompactedError:
                continue
            sys.stdout.flush()
            if not args.follow:
                return EXIT_OK
            time.sleep(0.5)
    except KeyboardInterrupt:
        return EXIT_OK
    except BrokenPipeError:
        return EXIT_OK
    except CorruptLogError as exc:
        print(f"dynaresized: {path}: {exc}", file=sys.stderr)
        return EXIT_FAIL
    finally:
        recorder.close()


def _history_from(start: LogStart | None, position: int) -> int:
    """Where `events` reads on from: after `position`, or after the log's start if a compaction
    dropped the facts before it, which it says on stderr."""
    if start is None or position >= start.position:
        return position
    print(f"dynaresized: {start.summary()} (the retention in [store], docs/store.md): the history here starts "
          f"at position {start.position + 1}", file=sys.stderr)
    return start.position


def _cmd_store(args: argparse.Namespace) -> int:
    from dynaresized.store.__main__ import main

    return main(args.args, prog="dynaresized store")


def _cmd_conformance(args: argparse.Namespace) -> int:
    from dynaresized.conformance import main

    return main(args.args, prog="dynaresized conformance")


def _cmd_keygen(args: argparse.Namespace) -> int:
    from dynaresized.daemon.security import keygen

    try:
        public, secret = keygen(args.dir, args.name)
    except FileExistsError as exc:
        print(f"dynaresized: {exc}", file=sys.stderr)
        return EXIT_FAIL
    print(f"public key: {public}\nsecret key: {secret} (keep it private; mode 0600)")
    return EXIT_OK


def _cmd_check_config(args: argparse.Namespace) -> int:
    """What `serve` checks before it binds or writes, with the words `serve` would print."""
    from dynaresized.daemon.config import ConfigError, config_warnings
    from dynaresized.daemon.preflight import StartupError, check_startup, held_by

    try:
        config, path = _config_for_daemon(args.config)
    except ConfigError as exc:
        print(f"dynaresized: {exc}", file=sys.stderr)
        return EXIT_NOT_CONFIGURED
    try:
        check_startup(config, read_log=True)
    except StartupError as exc:
        # The reason is serve's own words; only the lead differs: nothing tried to start here.
        print(f"dynaresized: {path}: serve would refuse to start: {exc}", file=sys.stderr)
        return EXIT_NOT_CONFIGURED
    for key, why in config_warnings(config):
        print(f"dynaresized: warning: {path}: {key}: {why}", file=sys.stderr)
    if held := held_by(config):
        print(f"dynaresized: note: {path}: a daemon runs on this state_dir, so `serve` would be refused "
              f"until it stops: {held}", file=sys.stderr)
    print(f"{path}: ok")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dynaresized",
        description="Move GPUs between the rollout and training stages of RL post-training at run time.",
        epilog="Start with `dynaresized demo`. Docs: README.md and docs/.",
    )
    parser.add_argument("--version", action="version", version=f"dynaresized {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    where = f"default ${CONFIG_ENV}, else {DEFAULT_CONFIG}"
    p = sub.add_parser("serve", help="run the daemon (what systemd starts)")
    p.add_argument("--config", help=f"TOML configuration ({where})")
    p.set_defaults(run=_cmd_serve)

    p = sub.add_parser("check-config", help="run every check `serve` makes before it starts, then exit")
    p.add_argument("--config", help=f"TOML configuration ({where})")
    p.set_defaults(run=_cmd_check_config)

    def client_args(p: argparse.ArgumentParser) -> None:
        p.add_argument("--config", help=f"read endpoints from this config ({where} if present)")
        p.add_argument("--control", help="the daemon's control endpoint (default: from the config, "
                                         "ipc://<state_dir>/control.sock unless set)")
        p.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the daemon (default 5)")

    p = sub.add_parser("status", help="pools, devices, workers and the resize in flight")
    client_args(p)
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=_cmd_status)

    p = sub.add_parser("events", help="print the event log (JSON lines when piped, text on a terminal)")
    p.add_argument("--config", help=f"read state_dir from this config ({where} if present)")
    p.add_argument("--state-dir", help="directory holding events.sqlite")
    p.add_argument("--follow", "-f", action="store_true", help="keep printing new events")
    p.add_argument("--json", action="store_true", help="JSON lines even on a terminal")
    p.add_argument("--since", type=int, default=0, metavar="N", help="only events after log position N")
    p.add_argument("--type", action="append", metavar="T",
                   help="only events of this type, e.g. resize_started (repeatable)")
    p.set_defaults(run=_cmd_events)

    # every argument goes to the store's own commands (python -m dynaresized.store, docs/store.md)
    p = sub.add_parser("store", add_help=False, prefix_chars="\0",
                       help="check, salvage or compact an event log file: `dynaresized store --help`")
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(run=_cmd_store)

    p = sub.add_parser("pause", help="stop starting resizes (the one in flight finishes)")
    client_args(p)
    p.add_argument("--reason", default="")
    p.set_defaults(run=_simple(lambda a: wire.PauseRequest(reason=a.reason)))

    p = sub.add_parser("resume", help="start resizing again (also clears 'degraded')")
    client_args(p)
    p.set_defaults(run=_simple(lambda a: wire.ResumeRequest()))

    p = sub.add_parser("resize", help="force a split now, e.g. `dynaresized resize 4:4` (skips hysteresis)")
    client_args(p)
    p.add_argument("split", help="train:rollout")
    p.add_argument("--reason", default="")
    p.add_argument("--wait", action="store_true", help="return once the resize has committed or rolled back")

    def resize_request(a: argparse.Namespace) -> wire.ResizeRequest:
        from dynaresized.domain import Split

        split = Split.parse(a.split)
        return wire.ResizeRequest(train=split.train, rollout=split.rollout, reason=a.reason)

    p.set_defaults(run=_simple(resize_request, "resizes"))

    p = sub.add_parser("regroup", help="make rollout devices serve as engines of TP devices each, e.g. "
                                       "`dynaresized regroup node0:gpu2,node0:gpu3 --tp 2` (and back with --tp 1)")
    client_args(p)
    p.add_argument("devices", help="comma-separated device ids, all in the rollout pool")
    p.add_argument("--tp", type=int, required=True, help="devices per engine (1 splits wide engines)")
    p.add_argument("--reason", default="")
    p.add_argument("--wait", action="store_true", help="return once the regroup has committed or rolled back")
    p.set_defaults(run=_simple(lambda a: wire.RegroupRequest(
        devices=tuple(d for d in a.devices.split(",") if d), tp=a.tp, reason=a.reason), "regroups"))

    p = sub.add_parser("drain", help="stop the daemon gracefully, like SIGTERM")
    client_args(p)
    p.set_defaults(run=_simple(lambda a: wire.DrainRequest()))

    # every argument goes to the checker's own parser (it has its own --help and `-- COMMAND`)
    p = sub.add_parser("conformance", add_help=False, prefix_chars="\0",
                       help="check a worker against docs/protocol.md: play the daemon on ENDPOINT and drive it")
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(run=_cmd_conformance)

    p = sub.add_parser("keygen", help="write a CurveZMQ key pair (for the daemon or a worker)")
    p.add_argument("name", help="key name; for a worker, its worker id")
    p.add_argument("--dir", default=".", help="output directory (default .)")
    p.set_defaults(run=_cmd_keygen)

    from dynaresized.demo import add_parser as add_demo
    from dynaresized.toy import add_parser as add_toy

    add_demo(sub)
    add_toy(sub)
    from dynaresized.sim.cli import add_parsers as add_sim
    from dynaresized.sim.cli import run_cli as run_sim

    add_sim(sub)
    for name in ("simulate", "plan", "bench"):
        sub.choices[name].set_defaults(run=run_sim)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code = int(args.run(args))
        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
        return code
    except ValueError as exc:
        print(f"dynaresized: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        # `dynaresized status | head -3`: the reader has what it wanted. Point stdout at
        # /dev/null so that the interpreter's own flush at exit does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
