"""A trainer process attached to the daemon: one `TrainerRank` behind one worker client.

    python -m dynaresized.backends.torch.worker --daemon tcp://127.0.0.1:5555 \\
        --store 127.0.0.1:29500 --devices node0:cpu0,node0:cpu1,node0:cpu2 --initial 2 --device node0:cpu2

Under torchrun (`torchrun --nproc-per-node N -m dynaresized.backends.torch.worker ...`) the
device is `devices[RANK]` and the store is the torchrun agent's, which outlives the workers.
The rank registers as a trainer for its device, answers the daemon's ops with
`TrainerRank.handlers()`, and (as the group's leader) reports `mini_batch_done` after each
optimizer step and each RL step's timing (`step_report`) after its last mini-batch.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any

import msgspec
import structlog

from dynaresized.backends.torch.membership import reachable_memberships
from dynaresized.backends.torch.store import StoreAddress
from dynaresized.backends.torch.trainer import (
    RestoreMode,
    StepRecord,
    TrainerConfig,
    TrainerRank,
    default_offload_dir,
)
from dynaresized.client import WorkerClient
from dynaresized.domain import StepTiming, WorkerKind

log = structlog.get_logger("dynaresized.backends.torch")


async def attach(rank: TrainerRank, endpoint: str, worker_id: str, *, rollout_work_s: float = 0.0,
                 hello_timeout_s: float = 10.0) -> None:
    """Serve the daemon's ops until training ends. `rollout_work_s` (device-seconds of
    rollout per step) lets a demo without real engines report a rollout time."""
    client = WorkerClient(endpoint, worker_id, WorkerKind.TRAINER_RANK, (rank.config.device,),
                          hello_timeout_s=hello_timeout_s, actual=rank.actual)
    client.on_all(rank.handlers())  # type: ignore[arg-type]
    await client.start()
    loop = asyncio.get_running_loop()
    total = len(rank.config.devices)

    seconds: dict[int, float] = {}  # RL step -> training seconds of its mini-batches so far

    def report(record: StepRecord) -> None:
        if record.members[0] != rank.rank:
            return  # one report per step: the group's leader sends it
        step = record.rl_step + 1  # the number the step's step_report carries
        asyncio.run_coroutine_threadsafe(
            client.report_mini_batch(step, record.mini_batch + 1, record.mini_batches), loop)
        # A leader that changed mid-step (a lent rank of lower id) sums only what it saw.
        seconds[record.rl_step] = seconds.get(record.rl_step, 0.0) + record.seconds
        if not record.ends_rl_step:
            return
        rollout_devices = max(total - len(record.members), 1)
        timing = StepTiming(step=step, rollout_s=rollout_work_s / rollout_devices,
                            train_s=seconds.pop(record.rl_step), train_devices=len(record.members),
                            rollout_devices=total - len(record.members))
        asyncio.run_coroutine_threadsafe(client.report_step(timing), loop)

    rank.on_step = report
    rank.start()
    try:
        view = await loop.run_in_executor(None, rank.wait)
        log.info("training ended", worker=worker_id, state=view.state.value, step=view.step)
    finally:
        await client.close(reason="training ended")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dynaresized.backends.torch.worker", description=__doc__.split("\n\n")[0])
    p.add_argument("--daemon", required=True, help="worker endpoint of the daemon, e.g. tcp://127.0.0.1:5555")
    p.add_argument("--store", help="host:port of the job's store host (default: the torchrun agent's store)")
    p.add_argument("--devices", required=True, help="comma-separated trainer devices of the job, in rank order")
    p.add_argument("--initial", type=int, required=True, help="how many devices (the first ones) train from step 0")
    p.add_argument("--device", help="this process's device (default: devices[$RANK])")
    p.add_argument("--worker-id", help="default: trainer<rank>")
    p.add_argument("--candidates", default="daemon",
                   help="groups to pre-warm: 'daemon' (every membership the daemon's device choice reaches "
                        "with --train-sizes), 'prefixes' (the first k devices), or ';'-separated comma lists")
    p.add_argument("--train-sizes", default="",
                   help="comma list of training-pool sizes the daemon may choose (its candidate splits); "
                        "default: every size from 1 to the number of devices")
    p.add_argument("--micro-batches", type=int, default=8, help="the global batch of one RL step")
    p.add_argument("--mini-batches", type=int, default=1,
                   help="optimizer steps per RL step; loans join at the boundaries between them")
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--restore", choices=[m.value for m in RestoreMode], default="lazy")
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    p.add_argument("--torch-device", default="cpu", help="cpu, cuda, cuda:N (cuda: cuda:$LOCAL_RANK)")
    p.add_argument("--staging-mib", type=int, default=64)
    p.add_argument("--offload", action="store_true", help="park released state in tmpfs and free it")
    p.add_argument("--steps", type=int, help="stop after this many steps")
    p.add_argument("--step-delay", type=float, default=0.0, help="floor on a step's seconds (demos)")
    p.add_argument("--rollout-work-s", type=float, default=0.0, help="device-seconds of rollout per step to report")
    p.add_argument("--collective-timeout", type=float, default=60.0)
    p.add_argument("--peer-timeout", type=float, default=5.0)
    p.add_argument("--job", default="dynaresized.backends.torch.jobs:SyntheticRegression")
    p.add_argument("--job-options", default='{"width": 4096, "depth": 3}', help="JSON keyword arguments of the job")
    p.add_argument("--log-level", default="info")
    return p.parse_args(argv)


def config_from_args(args: argparse.Namespace, environ: dict[str, str] | None = None) -> TrainerConfig:
    env = os.environ if environ is None else environ
    devices = tuple(d for d in args.devices.split(",") if d)
    if args.device:
        device = args.device
    elif "RANK" in env:
        rank = int(env["RANK"])
        if rank >= len(devices):
            raise ValueError(f"RANK={rank} but only {len(devices)} devices were given")
        device = devices[rank]
    else:
        raise ValueError("pass --device, or run under torchrun (which sets RANK)")
    if not 1 <= args.initial <= len(devices):
        raise ValueError(f"--initial must be between 1 and {len(devices)}")
    if args.candidates == "daemon":
        sizes = tuple(int(k) for k in args.train_sizes.split(",") if k) or tuple(range(1, len(devices) + 1))
        candidates = reachable_memberships(devices, devices[: args.initial], sizes)
    elif args.candidates == "prefixes":
        candidates = tuple(devices[:k] for k in range(args.initial, len(devices) + 1))
    else:
        candidates = tuple(tuple(x for x in group.split(",") if x) for group in args.candidates.split(";") if group)
    torch_device = args.torch_device
    if torch_device == "cuda":
        torch_device = f"cuda:{env.get('LOCAL_RANK', '0')}"
    return TrainerConfig(
        devices=devices, device=device, initial=devices[: args.initial], candidates=candidates,
        micro_batches=args.micro_batches, mini_batches=args.mini_batches, deterministic=args.deterministic, restore=RestoreMode(args.restore),
        backend=args.backend, torch_device=torch_device, staging_bytes=args.staging_mib << 20,
        collective_timeout_s=args.collective_timeout, peer_timeout_s=args.peer_timeout,
        offload_dir=default_offload_dir() if args.offload else None, steps_total=args.steps,
        step_delay_s=args.step_delay)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    level = getattr(__import__("logging"), args.log_level.upper())
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(level))
    config = config_from_args(args)
    if args.store:
        store = StoreAddress.parse(args.store)
    else:
        found = StoreAddress.from_env()
        if found is None:
            raise SystemExit("no store: pass --store host:port (a StoreHost: python -m "
                             "dynaresized.backends.torch.store), or run under torchrun")
        store = found
    from dynaresized.backends.torch.local import load_job

    options: dict[str, Any] = json.loads(args.job_options)
    rank = TrainerRank(config, load_job(args.job, options), store)
    started = time.perf_counter()
    report = rank.prepare()
    log.info("trainer ready", **report, seconds=round(time.perf_counter() - started, 3))
    log.debug("trainer config", config=msgspec.to_builtins(config))
    try:
        asyncio.run(attach(rank, args.daemon, args.worker_id or f"trainer{config.rank}",
                           rollout_work_s=args.rollout_work_s))
    finally:
        rank.close()
    return 0 if rank.fatal is None else 1


if __name__ == "__main__":
    sys.exit(main())
