"""The verl job's devices, pools and op mapping (no verl needed): the daemon accepts the printed
[cluster] section, the layout comes from verl's replica lists (or the V1 trainer's counts) with
the env vars only checked against them, and every loan op asks verl's hybrid replicas for a
state, never a toggle."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dynaresized.domain import OpKind, PlanKind, Pool
from dynaresized.integrations.verl.layout import LayoutMismatch, VerlLayout, hybrid_wanted
from tests.daemon.conftest import daemon_sections, write_config


def test_layout_devices_and_the_one_split() -> None:
    layout = VerlLayout(hybrid=2, standalone=1)
    assert layout.devices == ("verl:hybrid_0", "verl:hybrid_1", "verl:standalone_0")
    assert str(layout.split) == "2:1"  # the trainer group on every trainer GPU: never resized
    # standalone slots have no trainer worker: the daemon cannot lend them to training.
    assert not set(layout.standalone_devices) & set(layout.trainer_worker_devices)
    with pytest.raises(ValueError, match="at least one hybrid replica"):
        VerlLayout(hybrid=0, standalone=2)


def test_the_layout_comes_from_verl_and_the_env_vars_are_only_checked() -> None:
    assert VerlLayout.from_verl(["hybrid_1", "hybrid_0"], 3, env={}) == VerlLayout(hybrid=2, standalone=3)
    same = {"DYNARESIZED_VERL_HYBRID": "2", "DYNARESIZED_VERL_STANDALONE": "3"}
    assert VerlLayout.from_verl(["hybrid_0", "hybrid_1"], 3, env=same) == VerlLayout(hybrid=2, standalone=3)
    with pytest.raises(LayoutMismatch, match=r"DYNARESIZED_VERL_HYBRID=4, but verl has 2 hybrid replica\(s\)"):
        VerlLayout.from_verl(["hybrid_0", "hybrid_1"], 3, env={"DYNARESIZED_VERL_HYBRID": "4"})
    with pytest.raises(LayoutMismatch, match="not a number"):
        VerlLayout.from_verl(["hybrid_0"], 1, env={"DYNARESIZED_VERL_STANDALONE": "one"})
    with pytest.raises(LayoutMismatch, match="resource ids"):
        VerlLayout.from_verl(["rack3"], 1, env={})
    # verl's V1 trainer has replica counts, not resource ids: the same checks
    assert VerlLayout.from_counts(2, 3, env=same) == VerlLayout(hybrid=2, standalone=3)
    with pytest.raises(LayoutMismatch, match=r"DYNARESIZED_VERL_STANDALONE=1, but verl has 3 standalone"):
        VerlLayout.from_counts(2, 3, env={"DYNARESIZED_VERL_STANDALONE": "1"})


def test_printed_cluster_section_passes_check_config(tmp_path: Path) -> None:
    printed = subprocess.run([sys.executable, "-m", "dynaresized.integrations.verl", "--hybrid", "4",
                              "--standalone", "2"], capture_output=True, text=True, check=True).stdout
    sections = daemon_sections(tmp_path)
    del sections["cluster"]
    path = write_config(tmp_path / "verl.toml", sections)
    path.write_text(path.read_text() + "\n" + printed)
    result = subprocess.run([sys.executable, "-m", "dynaresized.cli", "check-config", "--config", str(path)],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert 'candidates = ["4:2"]' in printed


@pytest.mark.parametrize(("kind", "plan", "to_pool", "wanted"), [
    (OpKind.JOIN, PlanKind.LOAN, Pool.ROLLOUT, True),  # lent: verl activates after the training step
    (OpKind.EVICT, PlanKind.LOAN, Pool.ROLLOUT, False),  # undo of the join: asleep again
    (OpKind.DRAIN, PlanKind.RETURN, Pool.TRAINING, False),  # home: verl sleeps them before training
    (OpKind.RELEASE, PlanKind.RETURN, Pool.TRAINING, False),
    (OpKind.RESUME, PlanKind.RETURN, Pool.TRAINING, None),  # verl trains with them asleep, whatever
    (OpKind.JOIN, PlanKind.RECONCILE, Pool.ROLLOUT, None),
])
def test_each_rollout_op_names_the_hybrid_state_it_needs(kind: OpKind, plan: PlanKind, to_pool: Pool,
                                                         wanted: bool | None) -> None:
    assert hybrid_wanted(kind, plan, to_pool) is wanted


def test_a_resize_op_is_refused_verl_never_resizes() -> None:
    with pytest.raises(ValueError, match="never resizes"):
        hybrid_wanted(OpKind.JOIN, PlanKind.RESIZE, Pool.ROLLOUT)
