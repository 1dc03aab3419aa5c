"""What docs/configuration.md and docs/protocol.md tell a worker or tool author, checked against
the code: the control secret's format, and which `holding` a worker reports between the steps
of a resize, of a loan and of its return, and as a member of a wider engine (the sim backend's
workers against the documented tables)."""

from __future__ import annotations

import re
import stat
from pathlib import Path

from dynaresized import wire
from dynaresized.backends.sim import HOLDING_AFTER as SIM_HOLDING_AFTER
from dynaresized.backends.sim import after_op
from dynaresized.control import control_secret_file, read_control_secret
from dynaresized.daemon.security import load_control_secret
from dynaresized.domain import Holding, OpKind, PlanKind, Pool, WorkerKind
from dynaresized.protocol_doc import FOLLOWS_AFTER, HOLDING_AFTER, HOLDING_NOTES, LENT_FROM, LENT_TO, LOAN_STEPS


def test_the_control_secret_is_64_hex_characters_and_a_newline_sent_without_it(tmp_path: Path) -> None:
    secret = load_control_secret(tmp_path)
    path = control_secret_file(tmp_path)
    text = path.read_bytes()
    assert re.fullmatch(rb"[0-9a-f]{64}\n", text), text
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert secret == text[:-1] == read_control_secret(tmp_path)
    assert load_control_secret(tmp_path) == secret  # kept across starts


def test_an_existing_control_secret_is_used_as_it_is_without_surrounding_whitespace(tmp_path: Path) -> None:
    control_secret_file(tmp_path).write_bytes(b"  chosen-by-the-operator \n\n")
    assert load_control_secret(tmp_path) == b"chosen-by-the-operator" == read_control_secret(tmp_path)


def test_every_op_has_a_documented_holding_after_it() -> None:
    assert set(HOLDING_AFTER) == set(HOLDING_NOTES) == set(OpKind)


def test_the_sim_workers_report_what_the_protocol_says_after_each_op() -> None:
    # commit changes nothing on a sim worker's own device: it serves where it already is
    assert set(SIM_HOLDING_AFTER) == set(OpKind) - {OpKind.COMMIT}
    for kind, holding in SIM_HOLDING_AFTER.items():
        assert holding is HOLDING_AFTER[kind][0], kind


def _op(kind: OpKind, plan: PlanKind, engine: tuple[str, ...] = ()) -> wire.OpCommand:
    return wire.OpCommand(op_id=f"x/{kind.value}", resize_id="x", kind=kind, devices=("n0:gpu1",),
                          from_pool=Pool.ROLLOUT, to_pool=Pool.TRAINING, timeout_s=10.0, training=(), rollout=(),
                          plan=plan, engine=engine)


def test_the_sim_workers_report_what_the_loan_tables_say() -> None:
    # a rollout device lent to training: its engine is the lent-from worker, its trainer the lent-to one
    kind = {LENT_FROM: WorkerKind.ROLLOUT_ENGINE, LENT_TO: WorkerKind.TRAINER_RANK}
    for plan, steps in LOAN_STEPS.items():
        for step in steps:
            before = Holding.SERVING if step.op is OpKind.DRAIN else Holding.RELEASED
            after, _ = after_op(_op(step.op, plan), "n0:gpu1", kind[step.to], before, ())
            assert after is step.reports(step.to), (plan, step.op)


def test_a_sim_engine_whose_engine_another_device_leads_reports_released_after_the_documented_ops() -> None:
    for kind in FOLLOWS_AFTER:
        after, runs = after_op(_op(kind, PlanKind.REGROUP, ("n0:gpu0", "n0:gpu1")), "n0:gpu1",
                               WorkerKind.ROLLOUT_ENGINE, Holding.RELEASED, ("n0:gpu0", "n0:gpu1"))
        assert after is Holding.RELEASED, kind
