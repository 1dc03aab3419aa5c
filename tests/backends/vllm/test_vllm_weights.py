"""The weight store: versioned, atomic, immutable publication of safetensors."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="publishing weights needs the torch extra")
pytest.importorskip("safetensors", reason="publishing weights needs safetensors (the vllm extra)")

from safetensors.torch import load_file  # noqa: E402

from dynaresized.backends.vllm.weights import WEIGHTS_FILE, WeightStore, WeightVersionError  # noqa: E402


def test_publish_makes_a_readable_version_and_leaves_no_staging(tmp_path: Path) -> None:
    store = WeightStore(tmp_path / "w")
    assert store.latest() is None
    path = store.publish(3, {"a.weight": torch.ones(2, 3)})
    assert path == store.path(3) and path.name == "v00000003"
    assert torch.equal(load_file(str(path / WEIGHTS_FILE))["a.weight"], torch.ones(2, 3))
    store.publish(1, {"a.weight": torch.zeros(1)})
    assert store.versions() == [1, 3] and store.latest() == 3
    assert [p.name for p in (tmp_path / "w").iterdir() if p.name.startswith(".")] == []


def test_versions_are_immutable_and_missing_ones_are_named(tmp_path: Path) -> None:
    store = WeightStore(tmp_path)
    store.publish(0, {"x": torch.zeros(1)})
    with pytest.raises(FileExistsError, match="version 0 is already published"):
        store.publish(0, {"x": torch.ones(1)})
    with pytest.raises(WeightVersionError, match=r"version 9 is not published .*\[0\]"):
        store.path(9)
    with pytest.raises(ValueError, match="no tensors"):
        store.publish(2, {})


def test_a_failed_publish_leaves_nothing_behind(tmp_path: Path) -> None:
    store = WeightStore(tmp_path)
    with pytest.raises(Exception):
        store.publish(4, {"x": "not a tensor"})  # type: ignore[dict-item]
    assert list(tmp_path.iterdir()) == []
    assert store.versions() == []


def test_a_half_written_directory_is_not_a_version(tmp_path: Path) -> None:
    (tmp_path / "v00000005").mkdir()  # a crash between mkdir and write, without the rename
    store = WeightStore(tmp_path)
    assert store.versions() == []
    with pytest.raises(WeightVersionError):
        store.path(5)
