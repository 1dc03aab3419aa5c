"""Trainer ranks in real processes (gloo on 127.0.0.1) grow and shrink while training, through
the op sequences the daemon sends, including rolled-back resizes."""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="the torch backend tests need the torch extra (pip install -e '.[torch]')")

from dynaresized.backends.torch.trainer import RestoreMode  # noqa: E402
from dynaresized.domain import OpKind  # noqa: E402

from .cluster import DEVICES, assert_lockstep, by_step, finish, start, trainer_config  # noqa: E402

pytestmark = [pytest.mark.torch, pytest.mark.slow]

D0, D1, D2, D3 = DEVICES


def test_grow_to_four_and_back_with_rollbacks_keeps_every_rank_identical(tmp_path):
    job = start(trainer_config(offload_dir=str(tmp_path)))
    try:
        grow2 = job.grow(D2)
        grow3 = job.grow(D3)
        aborted_shrink = job.shrink(D3, abort_after=OpKind.RELEASE)  # drain, release, then reclaim, resume
        shrink3 = job.shrink(D3)
        aborted_grow = job.grow(D3, abort_after=OpKind.JOIN)  # join, then evict
        shrink2 = job.shrink(D2)
        histories = finish(job)
    finally:
        job.close()

    for outcome in (grow2, grow3, shrink3, shrink2):
        assert outcome.ok, outcome.failures()
    for outcome in (aborted_shrink, aborted_grow):
        assert not outcome.ok and not outcome.failures(), outcome.ops  # rolled back, every undo op succeeded
    assert [o.kind for o in aborted_shrink.ops] == [OpKind.DRAIN, OpKind.RELEASE, OpKind.RECLAIM, OpKind.RESUME]
    assert [o.kind for o in aborted_grow.ops] == [OpKind.JOIN, OpKind.EVICT]

    join = next(o for o in grow2.ops if o.kind is OpKind.JOIN)
    assert "verified" in join.detail and "from rank 0" in join.detail
    restore = next(o for o in grow2.ops if o.kind is OpKind.RESTORE)
    assert "at the first step" in restore.detail or "restored lazily" in restore.detail
    release = next(o for o in aborted_shrink.ops if o.kind is OpKind.RELEASE)
    reclaim = next(o for o in aborted_shrink.ops if o.kind is OpKind.RECLAIM)
    assert "parked in" in release.detail and "restored in place" in reclaim.detail
    resume = next(o for o in aborted_shrink.ops if o.kind is OpKind.RESUME)
    assert "joined epoch" in resume.detail  # rejoined with a transfer: the others had stepped on
    commits = [o for o in grow3.ops if o.kind is OpKind.COMMIT]
    assert len(commits) == 4 and all("split 2/2/2/2" in c.detail for c in commits)

    # every step: taken by exactly its members, batch split without gaps, states bitwise equal
    memberships = assert_lockstep(histories)
    assert memberships == [(0, 1), (0, 1, 2), (0, 1, 2, 3), (0, 1, 2), (0, 1, 2, 3), (0, 1, 2), (0, 1, 2, 3),
                           (0, 1, 2), (0, 1)]
    assert not list(tmp_path.iterdir())  # parked state files are removed once restored


def test_deterministic_mode_resized_run_is_bitwise_equal_to_a_never_resized_run():
    resized = start(trainer_config(deterministic=True, restore=RestoreMode.EAGER))
    try:
        outcomes = [resized.grow(D2), resized.grow(D3), resized.shrink(D3, D2), resized.grow(D2)]
        histories = finish(resized, extra_steps=2)
    finally:
        resized.close()
    assert all(o.ok for o in outcomes), [o.failures() for o in outcomes]
    memberships = assert_lockstep(histories)
    assert memberships == [(0, 1), (0, 1, 2), (0, 1, 2, 3), (0, 1), (0, 1, 2)]
    last_step, last = list(by_step(histories).items())[-1]

    plain = start(trainer_config(devices=DEVICES[:2], candidates=(), deterministic=True, steps_total=last_step))
    try:
        reference = finish(plain, extra_steps=10**6)  # stops at steps_total
    finally:
        plain.close()
    ref_steps = by_step(reference)
    assert max(ref_steps) == last_step
    assert assert_lockstep(reference) == [(0, 1)]
    ref = next(iter(ref_steps[last_step].values()))
    for device, rec in last.items():
        assert (rec["params_sha"], rec["optimizer_sha"]) == (ref["params_sha"], ref["optimizer_sha"]), device
    # and every intermediate step too, whatever the group size at that step
    for step, recs in by_step(histories).items():
        got = {(r["params_sha"], r["optimizer_sha"]) for r in recs.values()}
        want = {(r["params_sha"], r["optimizer_sha"]) for r in ref_steps[step].values()}
        assert got == want, f"step {step} differs from the never-resized run"
