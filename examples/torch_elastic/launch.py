"""Launch the elastic example: one trainer process per device, kept for the whole job.

Standalone (no daemon): the launcher hosts the store and issues the daemon's op sequences
itself on a schedule, printing what each resize did.

    python examples/torch_elastic/launch.py --nproc 4 --initial 2 \\
        --schedule grow@3,grow@6,shrink@9,shrink@12 --steps 15 --width 1024 --step-delay 0.2

With the daemon: the launcher hosts the store, starts `train.py` per device, and attaches a
stand-in rollout engine per device (it accepts its ops at once; real engines are the vllm
backend's). Resize with the daemon's policy or by hand: `dynaresized resize 3:1`.

    dynaresized serve --config examples/torch_elastic/daemon.toml &
    python examples/torch_elastic/launch.py --daemon tcp://127.0.0.1:5555
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from dynaresized.backends.torch.local import LocalJob
from dynaresized.backends.torch.membership import Registry
from dynaresized.backends.torch.store import StoreHost
from dynaresized.backends.torch.trainer import TrainerConfig, default_offload_dir

HERE = Path(__file__).resolve().parent
JOB = "dynaresized.backends.torch.jobs:SyntheticRegression"


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=4, help="trainer processes (one per device)")
    p.add_argument("--initial", type=int, default=2, help="devices training from step 0")
    p.add_argument("--node", default="node0")
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--step-delay", type=float, default=0.0, help="floor on a step's seconds (for tiny models)")
    p.add_argument("--schedule", default="grow@3,grow@6,shrink@9,shrink@12",
                   help="standalone: comma list of grow@STEP / shrink@STEP")
    p.add_argument("--steps", type=int, default=15, help="standalone: stop after this many steps")
    p.add_argument("--daemon", help="attach to this daemon worker endpoint instead of following --schedule")
    p.add_argument("--train-sizes", default="",
                   help="with --daemon: training-pool sizes of the daemon's candidate splits (default: "
                        "initial .. nproc-1, as in daemon.toml)")
    return p.parse_args(argv)


def standalone(args: argparse.Namespace, devices: tuple[str, ...]) -> int:
    config = TrainerConfig(devices=devices, device=devices[0], initial=devices[: args.initial],
                           candidates=tuple(devices[:k] for k in range(args.initial, len(devices) + 1)),
                           micro_batches=args.micro_batches, deterministic=args.deterministic,
                           offload_dir=default_offload_dir(), steps_total=args.steps,
                           step_delay_s=args.step_delay)
    plan = [(kind, int(at)) for kind, _, at in (item.partition("@") for item in args.schedule.split(",") if item)]
    with LocalJob(config, JOB, {"width": args.width, "depth": args.depth}, op_timeout_s=600) as job:
        print(f"starting {len(devices)} trainer processes; {args.initial} train from step 0", flush=True)
        job.start(600)
        leader = lambda: job.ranks[job.training[0]]  # noqa: E731
        for kind, at in plan:
            while leader().view()["step"] < at:
                time.sleep(0.05)
            if kind == "grow":
                outcome = job.grow(job.rollout[0])
            elif kind == "shrink":
                outcome = job.shrink(job.training[-1])
            else:
                raise SystemExit(f"bad schedule item {kind!r}: use grow@STEP or shrink@STEP")
            print(f"step {at}: {kind} -> {'ok' if outcome.ok else 'FAILED'} in {outcome.seconds:.2f}s; "
                  f"training on {', '.join(outcome.training)}", flush=True)
            for op in outcome.ops:
                print(f"    {op.kind.value:8s} {op.device}: {op.detail}", flush=True)
        for r in job.ranks.values():
            r.wait(3600)
        history = job.ranks[devices[0]].history()
        summary = {"steps": len(history), "resizes": [{"id": o.resize_id, "ok": o.ok, "training": o.training,
                                                        "seconds": round(o.seconds, 3)} for o in job.resizes],
                   "last_loss": history[-1]["loss"] if history else None}
        print(json.dumps(summary), flush=True)
    return 0


async def stand_in_engines(endpoint: str, devices: tuple[str, ...], stop: asyncio.Event) -> None:
    from dynaresized.client import OpRequest, WorkerClient
    from dynaresized.domain import OpKind, WorkerKind

    async def accept(op: OpRequest) -> str:
        return f"stand-in engine: {op.kind.value} on {', '.join(op.devices)}"

    clients = []
    for i, device in enumerate(devices):
        c = WorkerClient(endpoint, f"engine{i}", WorkerKind.ROLLOUT_ENGINE, (device,))
        c.on_all({kind: accept for kind in OpKind})
        await c.start()
        clients.append(c)
    await stop.wait()
    for c in clients:
        await c.close()


def with_daemon(args: argparse.Namespace, devices: tuple[str, ...]) -> int:
    host = StoreHost()
    procs = []
    for device in devices:
        cmd = [sys.executable, str(HERE / "train.py"), "--daemon", args.daemon, "--store", str(host.address),
               "--devices", ",".join(devices), "--initial", str(args.initial), "--device", device,
               "--micro-batches", str(args.micro_batches),
               "--train-sizes", args.train_sizes or ",".join(str(k) for k in range(args.initial, len(devices))),
               "--job-options", json.dumps({"width": args.width, "depth": args.depth})]
        if args.deterministic:
            cmd.append("--deterministic")
        if args.step_delay:
            cmd += ["--step-delay", str(args.step_delay)]
        procs.append(subprocess.Popen(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}))
    stop = asyncio.Event()

    async def run() -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGINT, stop.set)
        loop.add_signal_handler(signal.SIGTERM, stop.set)
        engines = asyncio.create_task(stand_in_engines(args.daemon, devices, stop))
        while not stop.is_set() and all(p.poll() is None for p in procs):
            await asyncio.sleep(0.2)
        stop.set()
        await engines

    print(f"store at {host.address}; {len(devices)} trainers attaching to {args.daemon}; Ctrl-C to stop", flush=True)
    asyncio.run(run())
    Registry(host.store, host.address.prefix).request_stop(0)  # every member stops at its next boundary
    codes = [p.wait(timeout=120) for p in procs]
    host.close()
    return max(codes, default=0)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    devices = tuple(f"{args.node}:cpu{i}" for i in range(args.nproc))
    return with_daemon(args, devices) if args.daemon else standalone(args, devices)


if __name__ == "__main__":
    sys.exit(main())
