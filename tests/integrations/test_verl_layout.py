"""The verl job's devices, pools and op mapping (no verl needed): the daemon accepts the printed
[cluster] section, and every op kind asks verl's hybrid replicas for a state, never a toggle."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dynaresized.domain import OpKind, Pool
from dynaresized.integrations.verl.layout import VerlLayout, hybrid_wanted
from tests.daemon.conftest import daemon_sections, write_config


def test_layout_devices_and_the_two_splits() -> None:
    layout = VerlLayout(hybrid=2, standalone=1)
    assert layout.devices == ("verl:trainer", "verl:hybrid_0", "verl:hybrid_1", "verl:standalone_0")
    assert (str(layout.asleep), str(layout.active)) == ("3:1", "1:3")
    # verl:trainer has no rollout worker and standalone slots no trainer worker: the daemon cannot move them.
    assert "verl:trainer" not in layout.rollout_worker_devices
    assert not set(layout.standalone_devices) & set(layout.trainer_worker_devices)
    with pytest.raises(ValueError, match="at least one hybrid replica"):
        VerlLayout(hybrid=0, standalone=2)
    with pytest.raises(ValueError, match="DYNARESIZED_VERL_HYBRID"):
        VerlLayout.from_env({"DYNARESIZED_VERL_HYBRID": "two"})


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
    assert 'candidates = ["5:2", "1:6"]' in printed


@pytest.mark.parametrize(("kind", "from_pool", "to_pool", "wanted"), [
    (OpKind.JOIN, Pool.TRAINING, Pool.ROLLOUT, True),
    (OpKind.RESTORE, Pool.TRAINING, Pool.ROLLOUT, True),
    (OpKind.EVICT, Pool.TRAINING, Pool.ROLLOUT, False),  # undo of join: back to sleep
    (OpKind.COMMIT, Pool.TRAINING, Pool.ROLLOUT, None),
    (OpKind.DRAIN, Pool.ROLLOUT, Pool.TRAINING, False),
    (OpKind.RELEASE, Pool.ROLLOUT, Pool.TRAINING, False),
    (OpKind.RESUME, Pool.ROLLOUT, Pool.TRAINING, True),  # undo of drain: awake again
    (OpKind.RECLAIM, Pool.ROLLOUT, Pool.TRAINING, True),
    (OpKind.COMMIT, Pool.ROLLOUT, Pool.TRAINING, None),
])
def test_each_rollout_op_names_the_hybrid_state_it_needs(kind: OpKind, from_pool: Pool, to_pool: Pool,
                                                         wanted: bool | None) -> None:
    assert hybrid_wanted(kind, from_pool, to_pool) is wanted
