"""Page wire format and page copies."""

from __future__ import annotations

import torch

from pdserve.transfer.wire import PageHeader, PageSource, block_runs, decode, encode


def test_message_round_trip_bfloat16() -> None:
    payload = torch.randn(2, 3, 4, 2, 8).to(torch.bfloat16)
    header = PageHeader("req-1", 5, [7, 8, 20], "bfloat16", list(payload.shape), 1, 3)
    got_header, got = decode(encode(header, payload))
    assert got_header == header
    assert got.dtype == torch.bfloat16 and torch.equal(got, payload)
    assert header.nbytes == payload.numel() * 2


def test_block_runs_group_consecutive_pairs() -> None:
    assert block_runs([3, 4, 5, 9], [10, 11, 12, 13]) == [(3, 10, 3), (9, 13, 1)]
    assert block_runs([], []) == []


def test_page_source_copies_only_its_heads_into_the_right_pages() -> None:
    src = torch.randn(2, 10, 4, 6, 8)  # [2, blocks, bs, heads, D]
    dst = torch.zeros(2, 12, 4, 3, 8)
    source = PageSource(src, [2, 3, 7], 3, 6)
    source.copy_into(dst, [5, 6, 0], 0, 3)
    for s, d in ((2, 5), (3, 6), (7, 0)):
        assert torch.equal(dst[:, d], src[:, s, :, 3:6])
    assert dst[:, [1, 2, 3, 4, 7]].abs().sum() == 0
    assert torch.equal(source.gather(), src[:, [2, 3, 7], :, 3:6])
