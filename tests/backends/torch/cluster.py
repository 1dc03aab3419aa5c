"""Shared set-up of the multi-process torch tests: a job of trainer processes on loopback gloo,
and checks over the per-step records the ranks keep (sha256 of parameters and optimizer state)."""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

from dynaresized.backends.torch.local import LocalJob
from dynaresized.backends.torch.trainer import TrainerConfig

DEVICES = tuple(f"node0:cpu{i}" for i in range(4))
JOB = "dynaresized.backends.torch.jobs:SyntheticRegression"
JOB_OPTIONS = {"width": 48, "depth": 2, "inputs": 16, "outputs": 4, "micro_batch_size": 4, "lr": 1e-2, "seed": 7}


def trainer_config(devices: tuple[str, ...] = DEVICES, initial: tuple[str, ...] = DEVICES[:2],
                   **overrides: Any) -> TrainerConfig:
    prefixes = tuple(devices[:n] for n in range(len(initial), len(devices) + 1))
    base: dict[str, Any] = dict(
        devices=devices, device=devices[0], initial=initial, candidates=prefixes, micro_batches=8,
        collective_timeout_s=20.0, peer_timeout_s=1.5, heartbeat_interval_s=0.1, record_digests=True,
        step_delay_s=0.01)
    base.update(overrides)
    return TrainerConfig(**base)


def start(config: TrainerConfig, warmup_steps: int = 2, **kw: Any) -> LocalJob:
    """Start the job and let it take `warmup_steps` steps (so optimizer state exists)."""
    job = LocalJob(config, JOB, JOB_OPTIONS, **kw)
    try:
        job.start()
        leader = job.ranks[job.training[0]]
        wait_for(lambda: leader.view()["step"] >= warmup_steps, what=f"{warmup_steps} steps")
    except BaseException:
        job.close()
        raise
    return job


def finish(job: LocalJob, extra_steps: int = 2) -> dict[str, list[dict[str, Any]]]:
    """Stop every member a couple of RL steps from now; return each rank's step records."""
    leader = job.ranks[job.training[0]]
    job.stop_at(leader.view()["step"] // job.base.mini_batches + extra_steps)
    for r in job.ranks.values():
        if r.process.is_alive():
            assert r.wait(60)["state"] == "finished"
    return {d: r.history() for d, r in job.ranks.items() if r.process.is_alive()}


def by_step(histories: dict[str, list[dict[str, Any]]]) -> dict[int, dict[str, dict[str, Any]]]:
    steps: dict[int, dict[str, dict[str, Any]]] = defaultdict(dict)
    for device, records in histories.items():
        for rec in records:
            steps[rec["step"]][device] = rec
    return dict(sorted(steps.items()))


def assert_lockstep(histories: dict[str, list[dict[str, Any]]], micro_batches: int = 8,
                    devices: tuple[str, ...] = DEVICES) -> list[tuple[int, ...]]:
    """Every step was taken by exactly its members, who split the global batch without gaps
    or overlaps and ended with bitwise identical parameters and optimizer state. Returns the
    sequence of memberships."""
    memberships: list[tuple[int, ...]] = []
    for step, recs in by_step(histories).items():
        members = {tuple(r["members"]) for r in recs.values()}
        assert len(members) == 1, f"step {step}: ranks disagree on the membership: {members}"
        (m,) = members
        alive = [r for r in m if devices[r] in histories]  # a killed rank's records died with it
        assert sorted(devices.index(d) for d in recs) == alive, f"step {step}: taken by {sorted(recs)}, members {m}"
        shares = [mb for r in recs.values() for mb in r["micro_batches"]]
        if len(alive) == len(m):
            (r0,) = list(recs.values())[:1]
            size = micro_batches // r0["mini_batches"]  # the step's mini-batch, in order
            want = list(range(r0["mini_batch"] * size, (r0["mini_batch"] + 1) * size))
            assert sorted(shares) == want, f"step {step}: micro-batches {shares}, want {want}"
        states = {(r["params_sha"], r["optimizer_sha"]) for r in recs.values()}
        assert len(states) == 1, f"step {step}: states differ across {sorted(recs)}: {states}"
        if not memberships or memberships[-1] != m:
            memberships.append(m)
    return memberships


def wait_for(predicate: Any, timeout: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)
