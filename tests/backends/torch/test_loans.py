"""Loans on real trainer processes (gloo on 127.0.0.1): a rank lent to training joins the RL
step in progress at a mini-batch boundary, computes part of the remaining mini-batches and goes
home at the RL-step boundary, and the parameters stay bitwise equal to a run without the loan."""

from __future__ import annotations

import time
from typing import Any

import pytest

pytest.importorskip("torch", reason="the torch backend tests need the torch extra (pip install -e '.[torch]')")

from dynaresized.backends.torch.local import LocalJob  # noqa: E402
from dynaresized.domain import OpKind  # noqa: E402

from .cluster import DEVICES, assert_lockstep, by_step, start, trainer_config, wait_for  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]

D0, D1, D2, D3 = DEVICES
MINI = 3  # mini-batches (optimizer steps) per RL step: boundaries inside the step after mini-batch 0 and 1
MICRO = 12  # micro-batches per RL step: 4 per mini-batch, so up to 4 ranks
RL_STEPS = 8


def loan_config(**overrides: Any) -> Any:
    base: dict[str, Any] = dict(micro_batches=MICRO, mini_batches=MINI, deterministic=True, steps_total=RL_STEPS,
                                step_delay_s=0.25)
    base.update(overrides)
    return trainer_config(**base)


def run_to_end(job: LocalJob) -> dict[str, list[dict[str, Any]]]:
    for r in job.ranks.values():
        assert r.wait(120)["state"] == "finished"
    return {d: r.history() for d, r in job.ranks.items()}


def in_mini_batch(job: LocalJob, mini: int, after_rl_step: int) -> None:
    """Wait until the group is in mini-batch `mini` of an RL step after `after_rl_step`."""
    leader = job.ranks[job.training[0]]
    wait_for(lambda: (lambda s: s // MINI > after_rl_step and s % MINI == mini)(leader.view()["step"]),
             what=f"mini-batch {mini} of an RL step after {after_rl_step}")


def lend_in_step(job: LocalJob, devices: tuple[str, ...], after_rl_step: int, *, abort: bool = False) -> Any:
    """Lend while mini-batch 0 of an RL step runs, so the loan enters at the boundary after it.
    A JOIN that reaches the leader at the RL-step boundary itself (a loaded machine) is refused;
    lend again in the next step then."""
    for attempt in range(3):
        in_mini_batch(job, 0, after_rl_step + attempt)
        time.sleep(0.03)  # the view shows the new step just before the leader scans its boundary
        loan = job.lend(*devices, abort=abort)
        if loan.ok or (abort and loan.ops[0].ok) or "no boundary left" not in loan.ops[0].detail:
            return loan
    return loan


def digests(histories: dict[str, list[dict[str, Any]]]) -> dict[int, set[tuple[str, str]]]:
    return {step: {(r["params_sha"], r["optimizer_sha"]) for r in recs.values()}
            for step, recs in by_step(histories).items()}


@pytest.fixture(scope="module")
def reference() -> dict[int, set[tuple[str, str]]]:
    """The same job without any loan: the digests after every optimizer step."""
    job = start(loan_config(devices=DEVICES[:2], candidates=()), warmup_steps=0)
    try:
        histories = run_to_end(job)
    finally:
        job.close()
    assert assert_lockstep(histories, micro_batches=MICRO) == [(0, 1)]
    ref = digests(histories)
    assert sorted(ref) == list(range(1, RL_STEPS * MINI + 1)) and all(len(v) == 1 for v in ref.values())
    return ref


def test_a_rank_lent_mid_step_joins_at_a_mini_batch_boundary_and_leaves_at_the_step_boundary(reference):
    job = start(loan_config(), warmup_steps=MINI)  # one RL step done: optimizer state exists
    try:
        loans = []
        for lent, after in (((D2,), 1), ((D2, D3), 3)):
            loan = lend_in_step(job, lent, after)
            assert loan.ok, loan.ops
            for d in lent:  # at the RL-step boundary the lent ranks leave by themselves...
                wait_for(lambda d=d: job.ranks[d].view()["state"] == "drained", what=f"{d} to go home")
            home = job.return_loan(*lent)  # ...and the core's RETURN, sent after the step report, finds them out
            assert home.ok, home.ops
            loans.append((loan, home))
        histories = run_to_end(job)
    finally:
        job.close()

    # a lent rank trains from a boundary inside the RL step it was lent in to that step's end
    for device, times_lent in ((D2, 2), (D3, 1)):
        per_step: dict[int, list[int]] = {}
        for r in histories[device]:
            per_step.setdefault(r["rl_step"], []).append(r["mini_batch"])
        assert len(per_step) == times_lent, (device, per_step)
        for minis in per_step.values():
            assert minis[0] >= 1 and minis == list(range(minis[0], MINI)), (device, per_step)
    memberships = assert_lockstep(histories, micro_batches=MICRO)
    assert memberships == [(0, 1), (0, 1, 2), (0, 1), (0, 1, 2, 3), (0, 1)], memberships

    # bitwise equal to the run without loans after every optimizer step
    got = digests(histories)
    assert sorted(got) == sorted(reference)
    for step in got:
        assert got[step] == reference[step], f"optimizer step {step} differs from the run without loans"

    for loan, home in loans:
        (join, *_) = [o for o in loan.ops if o.kind is OpKind.JOIN]
        assert "joined epoch" in join.detail and "verified" in join.detail, join.detail
        drain = next(o for o in home.ops if o.kind is OpKind.DRAIN)
        assert "already drained" in drain.detail, drain.detail


def test_a_loan_that_arrives_in_the_last_mini_batch_is_refused_with_the_reason():
    job = start(loan_config(steps_total=6), warmup_steps=MINI)
    try:
        for attempt in range(3):
            in_mini_batch(job, MINI - 1, attempt)  # the last mini-batch runs: no boundary of this step is left
            loan = job.lend(D2)
            if not loan.ok:
                break
            # a loaded machine delayed the JOIN past the boundary, so it joined the next step: again
            wait_for(lambda: job.ranks[D2].view()["state"] == "drained", what="the loan to go home")
            assert job.return_loan(D2).ok
        histories = run_to_end(job)
    finally:
        job.close()
    assert not loan.ok
    join = next(o for o in loan.ops if o.kind is OpKind.JOIN)
    assert not join.ok and "no boundary left inside the training step" in join.detail, join.detail
    evict = next(o for o in loan.ops if o.kind is OpKind.EVICT)  # the daemon's rollback finds nothing to undo
    assert evict.ok and "nothing to evict" in evict.detail, evict.detail
    memberships = assert_lockstep(histories, micro_batches=MICRO)
    if attempt == 0:
        assert memberships == [(0, 1)] and histories[D2] == []


def test_without_mini_batches_a_loan_is_refused_since_the_step_has_no_boundary_inside():
    job = start(loan_config(mini_batches=1, micro_batches=8, steps_total=4), warmup_steps=1)
    try:
        loan = job.lend(D2)
        run_to_end(job)
    finally:
        job.close()
    join = next(o for o in loan.ops if o.kind is OpKind.JOIN)
    assert not join.ok and "mini_batches=1" in join.detail, join.detail


def test_a_loan_join_rolled_back_by_evict_restores_the_previous_membership(reference):
    job = start(loan_config(), warmup_steps=MINI)
    try:
        loan = lend_in_step(job, (D2,), 1, abort=True)  # join, then the daemon's rollback: evict
        wait_for(lambda: job.ranks[D2].view()["state"] == "idle", what="the evicted rank to give the device back")
        histories = run_to_end(job)
    finally:
        job.close()
    assert not loan.ok and not loan.failures(), loan.ops
    assert [o.kind for o in loan.ops] == [OpKind.JOIN, OpKind.EVICT]
    assert assert_lockstep(histories, micro_batches=MICRO) == [(0, 1), (0, 1, 2), (0, 1)]
    got = digests(histories)
    assert all(got[step] == reference[step] for step in got), "the rolled-back loan changed the parameters"


def half_posted_return(job: LocalJob) -> tuple[Any, Any]:
    """Lend D2 and D3 in an RL step, then send the daemon's RETURN drain to D2 while it still
    trains: D2 posts a drain of both and waits (D3 leaves at the boundary by itself). The
    drain, and D2's answer to come."""
    loan = lend_in_step(job, (D2, D3), 1)
    assert loan.ok, loan.ops
    drain = job.command(OpKind.DRAIN, (D2, D3), training=job.training, resize_id="l9-home")
    return drain, job.ranks[D2].op(drain)


def test_a_return_that_reaches_one_lent_rank_before_the_boundary_and_one_after_blocks_nothing(reference):
    # The daemon's RETURN (a drain of every lent device) races the lent ranks' own leaving at
    # the RL-step boundary: here it reaches D2 while D2 still trains (D2 posts a drain of D2 and
    # D3) and D3 once D3 has left. D3 never posts that drain. It must not hold back every later
    # membership change (it did: the return timed out, and so did everything queued behind it).
    job = start(loan_config(step_delay_s=1.0, steps_total=6), warmup_steps=MINI)  # slow mini-batches: room to race
    try:
        drain, early = half_posted_return(job)
        wait_for(lambda: job.ranks[D3].view()["state"] == "drained", what="D3 to go home by itself")
        ok, late = job.ranks[D3].op(drain).result(30)
        assert ok and late.startswith("already drained"), late
        ok, detail = early.result(30)
        assert ok and not detail.startswith("already drained"), detail  # it did race the boundary
        release = job.command(OpKind.RELEASE, (D2, D3), training=job.training, resize_id="l9-home")
        assert all(job.ranks[d].op(release).result(30)[0] for d in (D2, D3))
        # the next loan is not held back behind the half-posted drain, nor is the run's end
        again = lend_in_step(job, (D2,), 3)  # not in the last RL step (0-5): it goes home at a boundary
        assert again.ok, again.ops
        wait_for(lambda: job.ranks[D2].view()["state"] == "drained", what="the second loan to go home")
        assert job.return_loan(D2).ok
        histories = run_to_end(job)
    finally:
        job.close()
    got = digests(histories)
    assert sorted(got) == list(range(1, 6 * MINI + 1))
    assert all(got[step] == reference[step] for step in got), "the loans changed the parameters"


def test_a_resume_after_a_half_posted_return_rejoins_a_rank_that_went_home_meanwhile(reference):
    # The daemon's rollback of that RETURN (RESUME) cancels the drain D2 posted, which never
    # took effect; but D2 left by the home change meanwhile, so it must join again, not say
    # "still training" while it is drained (the daemon's log would then differ from the rank).
    job = start(loan_config(step_delay_s=1.0, steps_total=6), warmup_steps=MINI)  # slow mini-batches: room to race
    try:
        _, early = half_posted_return(job)
        wait_for(lambda: job.ranks[D2].view()["state"] == "drained", what="D2 to go home by itself")
        assert early.result(30)[0]
        resume = job.command(OpKind.RESUME, (D2, D3), training=(D0, D1, D2, D3), resize_id="l9-home")
        answers = {d: job.ranks[d].op(resume) for d in (D2, D3)}  # D3: no drain of its own to cancel
        for d, answer in answers.items():
            ok, detail = answer.result(60)
            assert ok and "still training" not in detail, (d, detail)
            assert job.ranks[d].view()["state"] == "training", d
        histories = run_to_end(job)
    finally:
        job.close()
    memberships = assert_lockstep(histories, micro_batches=MICRO)
    assert memberships[-1] == (0, 1, 2, 3), memberships
    got = digests(histories)
    assert sorted(got) == list(range(1, 6 * MINI + 1))
    assert all(got[step] == reference[step] for step in got), "the resumed ranks changed the parameters"


def test_a_rank_lent_to_the_rollout_between_steps_holds_the_group_at_the_gate_and_changes_nothing(
        reference, tmp_path):
    """The other way (verl's hybrid replicas): a member waiting for the next RL step's samples
    is lent to the rollout (drain, release with plan LOAN). It stays a member; the group waits at
    the start of the step, even once the samples are there, until the rank is home (join with
    plan RETURN); inside a step the loan is refused. The run equals the run without the loan."""
    from dynaresized.backends.torch.local import LocalJob

    from .cluster import JOB, JOB_OPTIONS

    def samples_ready(step: int) -> None:
        (tmp_path / f"step-{step}").touch()

    for step in (0, 1):
        samples_ready(step)
    job = LocalJob(loan_config(devices=DEVICES[:2], candidates=()), JOB, {**JOB_OPTIONS, "ready_dir": str(tmp_path)})
    try:
        job.start()
        leader = job.ranks[D0]
        wait_for(lambda: leader.view()["step"] == 2 * MINI, what="two RL steps, then the wait for step 2's samples")
        loan = job.lend_to_rollout(D1)
        assert loan.ok, loan.ops
        drain = next(o for o in loan.ops if o.kind is OpKind.DRAIN)
        assert "parked before RL step 2 (it waits for its samples)" in drain.detail, drain.detail
        assert job.ranks[D1].view()["state"] == "idle"  # holds nothing: what the log wants of a lent device
        samples_ready(2)
        time.sleep(1.5)  # the samples are there, but a member is lent: nobody starts the step
        assert leader.view()["step"] == 2 * MINI and job.ranks[D1].view()["step"] == 2 * MINI
        home = job.home_from_rollout(D1)
        assert home.ok and "home from the rollout before RL step 2" in home.ops[0].detail, home.ops
        # inside a step (mini-batch 2 of 3 of RL step 3) a trainer has work of its own: refused
        samples_ready(3)
        in_mini_batch(job, 1, 2)
        inside = job.lend_to_rollout(D1)
        assert not inside.ok and "is training RL step 3" in inside.ops[0].detail, inside.ops
        assert [o.kind for o in inside.ops] == [OpKind.DRAIN, OpKind.RESUME]  # the undo finds nothing to undo
        for step in range(4, RL_STEPS):
            samples_ready(step)
        histories = run_to_end(job)
    finally:
        job.close()
    assert assert_lockstep(histories, micro_batches=MICRO) == [(0, 1)]  # one group all along
    got = digests(histories)
    assert got == reference, "a loan to the rollout changed what the group trained"
