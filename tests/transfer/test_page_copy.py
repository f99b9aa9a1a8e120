"""The shared-memory sender's copy places every page of a message where its run says.

Each case is checked page by page against plain tensor indexing, in float32
and bfloat16, with the copy on one thread and split over torch's threads.
"""

from __future__ import annotations

import pytest
import torch

from pdserve.transfer.page_copy import LayerPages, copy_runs
from pdserve.transfer.wire import PageHeader, PageRun, PageSource

LAYERS, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM = 3, 12, 4, 2, 8
ONE_THREAD, EVERY_THREAD = 1 << 60, 0  # parallel_from


def caches(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(source, destination), [layers, 2, blocks, bs, heads, D]; every source element distinct."""
    shape = (LAYERS, 2, BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)
    n = LAYERS * 2 * BLOCKS * BLOCK_SIZE * HEADS * HEAD_DIM
    source = (torch.arange(n, dtype=torch.float32) % 251).to(dtype).view(shape)
    return source, torch.full(shape, -1.0, dtype=dtype)


def runs_of(source: torch.Tensor, spec: list[tuple]) -> list[PageRun]:
    """``spec``: (request, src layer, dst layer, src blocks, src heads, dst blocks, dst heads)."""
    runs: list[PageRun] = []
    for request_id, src_layer, layer, src, (s0, s1), dst, (d0, d1) in spec:
        shape = [2, len(src), BLOCK_SIZE, s1 - s0, HEAD_DIM]
        header = PageHeader(request_id, layer, dst, "float32", shape, d0, d1)
        runs.append((header, PageSource(source[src_layer], src, s0, s1)))
    return runs


def expected(source: torch.Tensor, before: torch.Tensor, spec: list[tuple]) -> torch.Tensor:
    out = before.clone()
    for _, src_layer, layer, src, (s0, s1), dst, (d0, d1) in spec:
        for s, d in zip(src, dst, strict=True):
            out[layer, :, d, :, d0:d1] = source[src_layer, :, s, :, s0:s1]
    return out


# Requests whose pages follow one another on both sides (one copy), a request
# with scattered and reversed pages, a head slice (re-sharding between TP
# sizes) beside whole pages, and runs for two layers in one message.
CASES = {
    "next_to_each_other": [
        ("r1", 0, 0, [0, 1], (0, 2), [4, 5], (0, 2)),
        ("r2", 0, 0, [2, 3, 4], (0, 2), [6, 7, 8], (0, 2)),
        ("r3", 0, 0, [5], (0, 2), [9], (0, 2)),
    ],
    "scattered": [
        ("r1", 1, 1, [7, 2, 3, 11], (0, 2), [0, 10, 11, 5], (0, 2)),
        ("r2", 1, 1, [9, 8], (0, 2), [3, 2], (0, 2)),
    ],
    "head_slice_beside_whole_pages": [
        ("r1", 2, 2, [1, 2], (1, 2), [3, 4], (0, 1)),
        ("r2", 2, 2, [5, 6], (0, 2), [7, 8], (0, 2)),
        ("r3", 2, 2, [9], (0, 1), [11], (1, 2)),
    ],
    "two_layers": [
        ("r1", 0, 2, [3, 4], (0, 2), [0, 1], (0, 2)),
        ("r1", 2, 0, [3, 4], (0, 2), [0, 1], (0, 2)),
        ("r2", 1, 1, [10], (0, 2), [6], (0, 2)),
    ],
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("parallel_from", [ONE_THREAD, EVERY_THREAD])
@pytest.mark.parametrize("case", sorted(CASES))
def test_every_page_lands_in_its_slot(case: str, parallel_from: int, dtype: torch.dtype) -> None:
    source, dest = caches(dtype)
    want = expected(source, dest, CASES[case])
    layers = [LayerPages.of(layer) for layer in dest.unbind(0)]
    nbytes = copy_runs(layers, runs_of(source, CASES[case]), parallel_from)
    assert torch.equal(dest, want)
    size = dest.element_size()
    assert nbytes == sum(
        2 * len(src) * BLOCK_SIZE * (h1 - h0) * HEAD_DIM * size
        for *_, src, (h0, h1), _, _ in CASES[case]
    )


@pytest.mark.parametrize(
    "src, dst", [([0, BLOCKS], [0, 1]), ([0, 1], [BLOCKS - 1, BLOCKS]), ([-1], [0])]
)
def test_a_page_outside_either_cache_is_refused_and_nothing_moves(src, dst) -> None:
    source, dest = caches(torch.float32)
    layers = [LayerPages.of(layer) for layer in dest.unbind(0)]
    spec = [("r1", 0, 0, src, (0, HEADS), dst, (0, HEADS))]
    with pytest.raises(RuntimeError, match="outside the caches"):
        copy_runs(layers, runs_of(source, spec), ONE_THREAD)
    assert (dest == -1).all()
