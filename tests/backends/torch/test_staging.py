"""The bounded staging buffer: chunks never exceed the budget, every chunk is a view of the one
pre-allocated buffer, and restore writes back in place."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the torch backend tests need the torch extra (pip install -e '.[torch]')")

from dynaresized.backends.torch.staging import StagingBuffer  # noqa: E402
from dynaresized.backends.torch.state import digest  # noqa: E402

pytestmark = pytest.mark.torch


def tensors() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(1000, generator=gen), torch.randn(3, 7, generator=gen).to(torch.bfloat16),
            torch.tensor(5.0), torch.randint(0, 100, (257,), generator=gen), torch.empty(0)]


def test_chunks_cover_every_byte_once_within_the_budget():
    ts = tensors()
    staging = StagingBuffer(1000)
    chunks = staging.chunks(ts)
    total = sum(t.numel() * t.element_size() for t in ts)
    assert sum(StagingBuffer.chunk_bytes(c) for c in chunks) == total
    assert all(StagingBuffer.chunk_bytes(c) <= 1000 for c in chunks)
    assert len(chunks) == -(-total // 1000)  # full chunks except the last
    covered = {i: 0 for i in range(len(ts))}
    for chunk in chunks:
        for p in chunk:
            assert p.start == covered[p.tensor]  # in order, no gap, no overlap
            covered[p.tensor] = p.stop
    assert [covered[i] for i in range(len(ts))] == [t.numel() * t.element_size() for t in ts]


def test_save_streams_views_of_the_one_buffer_and_restore_writes_in_place():
    ts = tensors()
    before = digest(ts, strong=True)
    staging = StagingBuffer(512)
    base = staging.buffer.data_ptr()
    received: list[bytes] = []

    def sink(view: torch.Tensor) -> None:
        assert view.numel() <= 512 and view.data_ptr() == base  # nothing allocated per chunk
        received.append(bytes(view.numpy()))

    sent = staging.save(ts, sink)
    assert sent == sum(len(b) for b in received)
    pointers = [t.data_ptr() for t in ts]
    for t in ts:
        t.zero_()
    chunks = iter(received)
    staging.restore(ts, lambda view: view.copy_(torch.frombuffer(bytearray(next(chunks)), dtype=torch.uint8)))
    assert digest(ts, strong=True) == before
    assert [t.data_ptr() for t in ts] == pointers  # restored in place


def test_file_round_trip_and_size_check(tmp_path):
    ts = tensors()
    before = digest(ts, strong=True)
    staging = StagingBuffer(300)
    path = tmp_path / "state.bin"
    assert staging.save_to_file(ts, path) == path.stat().st_size
    for t in ts:
        t.fill_(0)
    staging.restore_from_file(ts, path)
    assert digest(ts, strong=True) == before
    with pytest.raises(ValueError, match="holds .* bytes but the tensors need"):
        staging.restore_from_file(ts[:2], path)


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="at least 1 byte"):
        StagingBuffer(0)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="pinned staging needs CUDA"):
            StagingBuffer(16, pin=True)
    with pytest.raises(ValueError, match="contiguous"):
        StagingBuffer(16).save([torch.zeros(4, 4).t()], lambda v: None)
