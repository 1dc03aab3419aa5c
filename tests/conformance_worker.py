"""A worker for the conformance tests: the project's client (`dynaresized.client.WorkerClient`)
with handlers that keep what the sim backend's workers keep (a holding after each op), or, with
`--break RULE`, the same client made to break one rule of docs/protocol.md.

    python tests/conformance_worker.py ENDPOINT [--kind trainer-rank] [--released] [--break rerun]

`--break` names a client class of BREAKS or a misreport of MISREPORTS.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from dynaresized import wire
from dynaresized.backends.sim import HOLDING_AFTER
from dynaresized.client import OpRequest, WorkerClient
from dynaresized.domain import ActualState, Holding, OpKind, WorkerKind


class RerunsResentOps(WorkerClient):
    """Breaks the dedup rule: a re-sent op id runs again instead of being answered from the record."""

    def _dispatch(self, cmd: wire.OpCommand) -> None:
        self._records.pop(cmd.op_id, None)
        super()._dispatch(cmd)


class IgnoresStaleToken(WorkerClient):
    """Breaks 'stale_token: send hello again'."""

    def _on_error(self, err: wire.Error) -> None:
        if err.reason != "stale_token":
            super()._on_error(err)


class AnswersWithTheOldToken(WorkerClient):
    """Reads 'sent again, unchanged' literally: a re-sent op's recorded answer keeps the token of
    the registration it was first sent under."""

    def _dispatch(self, cmd: wire.OpCommand) -> None:
        record = self._records.get(cmd.op_id)
        if record is None:
            super()._dispatch(cmd)
        else:
            asyncio.get_running_loop().create_task(self._send(record))


BREAKS: dict[str, type[WorkerClient]] = {"rerun": RerunsResentOps, "ignore-stale-token": IgnoresStaleToken,
                                         "old-token": AnswersWithTheOldToken}

MISREPORTS: dict[str, dict[OpKind, Holding]] = {"drained-after-join": {OpKind.JOIN: Holding.DRAINED}}
"""Handlers that report another holding than the protocol's tables: `drained-after-join` is the
client written from the resize table alone, waiting after every join for a commit that a loan
and its return never send."""


async def serve(args: argparse.Namespace) -> None:
    holding = Holding.RELEASED if args.released else Holding.SERVING
    last_op = ""
    after = {**HOLDING_AFTER, **MISREPORTS.get(args.breaks, {})}

    async def perform(op: OpRequest) -> str:
        nonlocal holding, last_op
        await asyncio.sleep(0.02)  # an op takes time: a re-run answers with another duration
        if op.kind in after:
            holding = after[op.kind]
        last_op = op.op_id
        return f"{op.kind.value} done"

    cls = BREAKS.get(args.breaks, WorkerClient)
    client = cls(args.endpoint, args.worker_id, WorkerKind(args.kind), (args.device,), hello_timeout_s=30,
                 actual=lambda: ActualState(holding=holding, last_op=last_op))
    client.on_all({kind: perform for kind in OpKind})
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await client.start()
    try:
        await stop.wait()
    finally:
        await client.close(reason="conformance run over")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("endpoint")
    p.add_argument("--worker-id", default="conformance-0")
    p.add_argument("--device", default="node0:gpu0")
    p.add_argument("--kind", default=WorkerKind.ROLLOUT_ENGINE.value, choices=[k.value for k in WorkerKind])
    p.add_argument("--released", action="store_true", help="start holding nothing (its device in the other pool)")
    p.add_argument("--break", dest="breaks", default="", choices=["", *BREAKS, *MISREPORTS])
    asyncio.run(serve(p.parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
