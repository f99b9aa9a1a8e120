"""Page wire format and page copies."""

from __future__ import annotations

import struct

import pytest
import torch

from pdserve.transfer.wire import (
    PageHeader,
    PageSource,
    block_runs,
    counts_up,
    decode,
    dtype_name,
    encode,
    pack_message,
    torch_dtype,
    unpack_message,
)


def test_message_round_trip_bfloat16() -> None:
    payload = torch.randn(2, 3, 4, 2, 8).to(torch.bfloat16)
    header = PageHeader("req-1", 5, [7, 8, 20], "bfloat16", list(payload.shape), 1, 3)
    got_headers, got = decode(encode([header], [payload]))
    assert got_headers == [header]
    assert got[0].dtype == torch.bfloat16 and torch.equal(got[0], payload)
    assert header.nbytes == payload.numel() * 2


def test_one_header_lists_every_run_and_mark_of_a_message() -> None:
    a = PageHeader("a", 1, [4, 5], "float32", [2, 2, 4, 3, 8], 0, 3)
    b = PageHeader("b", 1, [9], "float32", [2, 1, 4, 3, 8], 0, 3)
    assert unpack_message(pack_message([a, b], ["c", "c"])) == ([a, b], ["c", "c"])
    assert unpack_message(pack_message([], ["c"])) == ([], ["c"])
    payloads = [torch.randn(a.shape), torch.randn(b.shape)]
    headers, got = decode(encode([a, b], payloads))
    assert headers == [a, b]
    assert all(torch.equal(g, p) for g, p in zip(got, payloads, strict=True))


def test_block_runs_group_consecutive_pairs() -> None:
    assert block_runs([3, 4, 5, 9], [10, 11, 12, 13]) == [(3, 10, 3), (9, 13, 1)]
    assert block_runs([3, 4, 5], [7, 8, 9]) == [(3, 7, 3)]
    assert block_runs([0, 5, 2, 3], [0, 1, 2, 3]) == [(0, 0, 1), (5, 1, 1), (2, 2, 2)]
    assert block_runs([], []) == []
    assert counts_up([4, 5, 6]) and not counts_up([4, 6, 6]) and not counts_up([])


def test_page_source_copies_only_its_heads_into_the_right_pages() -> None:
    src = torch.randn(2, 10, 4, 6, 8)  # [2, blocks, bs, heads, D]
    dst = torch.zeros(2, 12, 4, 3, 8)
    source = PageSource(src, [2, 3, 7], 3, 6)
    source.copy_into(dst.transpose(0, 1), [5, 6, 0], 0, 3)  # the destination page-major
    for s, d in ((2, 5), (3, 6), (7, 0)):
        assert torch.equal(dst[:, d], src[:, s, :, 3:6])
    assert dst[:, [1, 2, 3, 4, 7]].abs().sum() == 0
    assert torch.equal(source.gather(), src[:, [2, 3, 7], :, 3:6])


def test_message_layout_is_length_header_then_raw_payload() -> None:
    payload = torch.arange(2 * 1 * 2 * 1 * 4, dtype=torch.float32).view(2, 1, 2, 1, 4)
    header = PageHeader("r", 0, [3], "float32", [2, 1, 2, 1, 4], 0, 1)
    strided = payload.transpose(2, 4).contiguous().transpose(2, 4)
    message = encode([header, header], [strided, payload])
    (n,) = struct.unpack("<I", message[:4])
    assert unpack_message(message[4 : 4 + n]) == ([header, header], [])
    assert message[4 + n :] == 2 * payload.numpy().tobytes()
    assert len(message) == 4 + n + 2 * header.nbytes


def test_decode_views_a_writable_buffer_and_copies_a_read_only_one() -> None:
    payload = torch.randn(2, 2, 4, 1, 8)
    header = PageHeader("r", 1, [0, 1], "float32", list(payload.shape), 0, 1)
    buffer = bytearray(encode([header], [payload]))
    _, (view,) = decode(buffer)
    buffer[-4:] = b"\0\0\0\0"  # the view sees the buffer change
    assert view.flatten()[-1] == 0
    _, (copy,) = decode(bytes(encode([header], [payload])))
    assert torch.equal(copy, payload)
    copy.zero_()  # a private copy: writable, and nothing else changes


@pytest.mark.parametrize(("dtype", "size"), [("float32", 4), ("bfloat16", 2), ("float16", 2)])
def test_header_sizes_and_dtype_names(dtype: str, size: int) -> None:
    header = PageHeader("r", 0, [1, 2], dtype, [2, 2, 16, 4, 64], 0, 4)
    assert header.nbytes == 2 * 2 * 16 * 4 * 64 * size
    assert dtype_name(torch_dtype(dtype)) == dtype


def test_contiguous_parts_only_without_a_copy() -> None:
    cache = torch.randn(2, 8, 4, 3, 8)
    parts = PageSource(cache, [2, 3, 4], 0, 3).contiguous_parts()
    assert parts is not None
    assert parts[0].data_ptr() == cache[0, 2].data_ptr()
    assert torch.equal(parts[1], cache[1, 2:5])
    assert PageSource(cache, [2, 4], 0, 3).contiguous_parts() is None  # a gap
    assert PageSource(cache, [2, 3], 1, 3).contiguous_parts() is None  # some heads
    assert PageSource(cache, [2, 3], 1, 3).nbytes == 2 * 2 * 4 * 2 * 8 * 4
