"""One trainer rank of the GRPO example: a `TrainerRank` on one device, attached to the daemon.

    python -m examples.grpo_tiny.trainer --work DIR --daemon tcp://127.0.0.1:5555 \\
        --store 127.0.0.1:29500 --devices node0:cpu0,node0:cpu1,node0:cpu2 --initial 1 \\
        --device node0:cpu1 --steps 30 --micro-batches 4 [--mini-batches 2] [--deterministic]

Every device of the job has one such process for the whole run. While its device is in the
rollout pool the rank is parked (idle, its state kept); the daemon's ops (join/restore/commit,
drain/release) move it in and out of the data-parallel group at step boundaries.

With `--mini-batches M` an RL step is M optimizer steps (M consecutive mini-batches of the
step's micro-batches); the boundaries between them are where a lent device's rank joins the
step in progress (`docs/torch-backend.md`), and the group's leader reports each one to the
daemon (`mini_batch_done`), which is what the daemon lends on.

After each optimizer step every rank appends what it trained (RL step, mini-batch,
micro-batches, sample ids) to `DIR/trained/rank<r>.jsonl` (the trained-once half of the
ledger). When an RL step's last mini-batch is done, its writer (the lowest rank that trained
the whole step: a lent rank, which joins inside it, never is) publishes
the new policy version to the `WeightStore` at `DIR/weights` (atomic rename; the engines reload
it at the next step boundary) and writes `DIR/trained/step-<k>.json` (seconds, members, loss,
parameter digest). When training ends it writes `DIR/trained/rank<r>.done` (its ledger is complete)
and stays attached until the driver creates `DIR/stop`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
from pathlib import Path

import structlog

from dynaresized.backends.torch.membership import reachable_memberships
from dynaresized.backends.torch.store import StoreAddress
from dynaresized.backends.torch.trainer import StepRecord, TrainerConfig, TrainerRank
from dynaresized.backends.vllm.weights import WeightStore
from dynaresized.client import WorkerClient
from dynaresized.domain import WorkerKind
from examples.grpo_tiny import task
from examples.grpo_tiny.job import GRPOJob
from examples.grpo_tiny.ledger import ledger_path, mark_done

log = structlog.get_logger("examples.grpo_tiny.trainer")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--work", required=True, help="the run's work directory (model, samples, weights)")
    p.add_argument("--daemon", required=True)
    p.add_argument("--store", required=True, help="host:port of the job's torch store host")
    p.add_argument("--devices", required=True)
    p.add_argument("--initial", type=int, required=True)
    p.add_argument("--device", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--mini-batches", type=int, default=1, help="optimizer steps per RL step (divides --micro-batches)")
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--deterministic", action="store_true")
    p.add_argument("--workload", choices=task.WORKLOADS, default="copy", help="the curriculum (its KL term per step)")
    p.add_argument("--collective-timeout", type=float, default=600.0)
    p.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    p.add_argument("--torch-device", default="cpu", help="cpu or cuda:N")
    return p.parse_args(argv)


def write_json(path: Path, data: object) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    work = Path(args.work)
    devices = tuple(d for d in args.devices.split(",") if d)
    config = TrainerConfig(
        devices=devices, device=args.device, initial=devices[: args.initial],
        candidates=reachable_memberships(devices, devices[: args.initial], tuple(range(1, len(devices) + 1))),
        micro_batches=args.micro_batches, mini_batches=args.mini_batches, deterministic=args.deterministic,
        steps_total=args.steps, record_digests=args.deterministic, collective_timeout_s=args.collective_timeout,
        peer_timeout_s=5.0, backend=args.backend, torch_device=args.torch_device)
    job = GRPOJob(str(work / "model"), str(work / "samples"), args.micro_batches, lr=args.lr,
                  kl_coef=task.workload(args.workload, args.steps).kl_coef,
                  reference_dir=str(work / "teacher") if args.workload == "shift" else None)
    rank = TrainerRank(config, job, StoreAddress.parse(args.store))
    weights = WeightStore(work / "weights")
    trained = work / "trained"
    trained.mkdir(exist_ok=True)
    ledger = ledger_path(trained, config.rank).open("a")

    # Per RL step, what this rank saw of it: the group of its first mini-batch, the ranks on loan
    # in it, and the seconds of its mini-batches.
    first_members: dict[int, tuple[int, ...]] = {}
    lent: dict[int, set[int]] = {}
    step_seconds: dict[int, float] = {}
    loop: asyncio.AbstractEventLoop | None = None
    client: WorkerClient | None = None

    def on_step(record: StepRecord) -> None:
        step = record.rl_step  # the RL step whose samples were just trained on (one mini-batch of it)
        ids = [sid for mb in record.micro_batches for sid in job.micro_batch_ids(step, mb)]
        ledger.write(json.dumps({"step": step, "mini_batch": record.mini_batch, "rank": config.rank,
                                 "micro_batches": list(record.micro_batches), "sample_ids": ids}) + "\n")
        ledger.flush()
        if record.members[0] == config.rank and loop is not None and client is not None:
            # the daemon's view of the step in progress: a loan joins at the next of these boundaries
            asyncio.run_coroutine_threadsafe(
                client.report_mini_batch(step, record.mini_batch + 1, record.mini_batches), loop)
        first_members.setdefault(step, tuple(record.members))
        lent.setdefault(step, set()).update(rank.lent)  # read on the step loop's thread, which changes it
        step_seconds[step] = step_seconds.get(step, 0.0) + record.seconds
        if not record.ends_rl_step:
            return
        seconds_all = step_seconds.pop(step)
        on_loan = lent.pop(step)
        # The writer: the lowest rank in the group from the step's first mini-batch to its last
        # (every member computes the same one; a rank that joined or left inside the step sums
        # only part of its time).
        if min(set(first_members.pop(step)) & set(record.members)) != config.rank:
            return
        model = rank.state.model
        weights.publish(step + 1, {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()})
        # The rank's step time counts its wait for the step's samples (rollout still running):
        # reported as training time, that wait would make a rollout-bound step look train-bound.
        seconds = max(seconds_all - job.waited_s.get(step, 0.0), 0.0)
        write_json(trained / f"step-{step:05d}.json",
                   {"step": step, "version": step + 1, "seconds": seconds, "step_seconds": seconds_all,
                    # the home group (the daemon's split) and the ranks lent to it for part of the step
                    "members": [devices[m] for m in record.members if m not in on_loan],
                    "lent": [devices[m] for m in sorted(on_loan)], "loss": record.loss,
                    "params_sha": record.params_sha})

    rank.on_step = on_step
    rank.prepare()

    async def serve() -> None:
        nonlocal loop, client
        client = WorkerClient(args.daemon, f"trainer{config.rank}", WorkerKind.TRAINER_RANK, (args.device,),
                              actual=rank.actual)
        client.on_all(rank.handlers())  # type: ignore[arg-type]
        await client.start()
        loop = asyncio.get_running_loop()
        rank.start()
        try:
            await asyncio.get_running_loop().run_in_executor(None, rank.wait)
            # The loop has ended: no ledger line can follow. The driver reads the ledgers only
            # once every rank says so (the step's publisher may be ahead of the others' writes).
            ledger.flush()
            mark_done(trained, config.rank, rank.view.state.value)
            # Stay attached until the driver says the run is over: the daemon aborts a resize
            # in flight when a training-pool worker says goodbye, and the last resize of a
            # run may still be starting an engine when training ends.
            while not (work / "stop").exists():
                await asyncio.sleep(0.1)
        finally:
            await client.close(reason="training ended")

    try:
        asyncio.run(serve())
    finally:
        rank.close()
        ledger.close()
    return 0 if rank.fatal is None else 1


if __name__ == "__main__":
    sys.exit(main())
