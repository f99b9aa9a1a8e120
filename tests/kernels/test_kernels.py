"""Each Triton kernel against its torch reference, and one whole engine on the kernels.

Without a GPU the kernels run in Triton's CPU interpreter: ``TRITON_INTERPRET``
must be set before any kernel module is imported (Triton picks the interpreter
when a kernel is decorated), so it is set here, at collection. Shapes are small
because the interpreter is slow. Tolerances per dtype are in :data:`TOL`.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pdserve.core.model_config import ModelConfig, RopeConfig
from pdserve.core.step import RowSampling, ScheduledSeq, StepPlan
from pdserve.distributed.context import SINGLE_RANK as SINGLE_RANK_CTX
from pdserve.kernels import KERNEL_OPS, reference_kernels, select_kernels
from pdserve.kernels.attention import AttentionMetadata, select_backend, torch_ref
from pdserve.kernels.reference import rms_norm_residual, route, silu_and_mul
from pdserve.kernels.reference import rotate as rotate_reference
from pdserve.kernels.torch_ops import TorchKernels
from pdserve.models.rotary import RotaryEmbedding
from pdserve.parallel.batch import prepare_batch
from tests.kernels.triton_check import triton_problem
from tests.reference import hf_greedy, parity_prompts

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Largest |got - want| allowed, absolute and relative, per activation dtype.
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 2e-2}


_PROBLEM = triton_problem(DEVICE)
if _PROBLEM is not None:
    pytest.skip(_PROBLEM, allow_module_level=True)

from pdserve.kernels import (  # noqa: E402 (after the skip: these import Triton)
    activation,
    decode_attention,
    kv_cache,
    norm,
    rotary,
    routing,
    support,
)


def assert_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    tol = TOL[dtype]
    assert got.shape == want.shape
    assert torch.allclose(got.float(), want.float(), atol=tol, rtol=tol), (
        (got.float() - want.float()).abs().max()
    )


def randn(*shape: int, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)


# -- row-wise ops --------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("tokens", "hidden"), [(1, 64), (37, 200)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_residual(dtype, tokens: int, hidden: int, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(tokens * hidden)
    x = randn(tokens, hidden, dtype=dtype, gen=gen)
    residual = randn(tokens, hidden, dtype=dtype, gen=gen) if with_residual else None
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype).to(DEVICE)
    got_out, got_res = norm.rms_norm_residual(x, residual, weight, 1e-5)
    want_out, want_res = rms_norm_residual(x, residual, weight, 1e-5)
    assert_close(got_out, want_out, dtype)
    # The new residual is an add in the activation dtype: exact, except that the
    # interpreter rounds float32 to bfloat16 by truncation (GPUs round to nearest).
    if dtype == torch.bfloat16 and support.INTERPRETED:
        assert_close(got_res, want_res, dtype)
    else:
        assert torch.equal(got_res, want_res)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 64), (9, 2 * 1100), (2, 3, 2 * 48)])
def test_silu_and_mul(dtype, shape: tuple[int, ...]) -> None:
    gen = torch.Generator().manual_seed(sum(shape))
    gate_up = 3 * randn(*shape, dtype=dtype, gen=gen)
    assert_close(activation.silu_and_mul(gate_up), silu_and_mul(gate_up), dtype)


LLAMA3 = RopeConfig(
    theta=500000.0,
    kind="llama3",
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=128,
)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rope", [RopeConfig(), LLAMA3], ids=["default", "llama3"])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 16), (6, 3, 24)])
def test_rotate_matches_rotary(dtype, rope, heads: int, kv_heads: int, head_dim: int) -> None:
    gen = torch.Generator().manual_seed(heads * head_dim)
    tokens = 11
    rotary_emb = RotaryEmbedding(head_dim, 1024, rope).to(DEVICE)
    positions = torch.randint(0, 1024, (tokens,), generator=gen).to(DEVICE)
    # q and k as the model has them: a strided view of the fused qkv output.
    qkv = randn(tokens, heads + 2 * kv_heads, head_dim, dtype=dtype, gen=gen)
    x = qkv[:, : heads + kv_heads]
    cos, sin = rotary_emb.tables(positions, dtype)
    want = rotate_reference(x, cos, sin)
    assert_close(rotary.rotate(x, cos, sin), want, dtype)
    # Whole float32 tables indexed by position in the kernel give the same result.
    assert_close(rotary.rotate(x, rotary_emb.cos, rotary_emb.sin, positions), want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("experts", "top_k"), [(8, 2), (6, 1), (5, 5)])
def test_route(dtype, experts: int, top_k: int) -> None:
    gen = torch.Generator().manual_seed(experts * 10 + top_k)
    tokens = 13
    # Distinct logits in every dtype (no ties to break), shifted per row.
    ranks = torch.rand(tokens, experts, generator=gen).argsort(-1).float()
    logits = (0.5 * ranks + torch.randn(tokens, 1, generator=gen)).to(dtype).to(DEVICE)
    got_w, got_e = routing.route(logits, top_k)
    want_w, want_e = route(logits, top_k)
    assert got_w.dtype == torch.float32 and got_e.dtype == torch.int64
    assert torch.equal(got_e, want_e)
    assert_close(got_w, want_w, torch.float32)


# -- KV cache and paged attention ----------------------------------------------

BLOCK = 16
# (cached tokens, new tokens) per sequence: one token with no context, exactly
# one block, decodes at and across a block boundary, a two-tile chunk after a
# prefix, a prefix that ends mid-block, and long decodes over several tiles.
LAYOUT = [(0, 1), (0, BLOCK), (BLOCK - 1, 1), (BLOCK, 1), (40, 90), (0, 7), (150, 1), (33, 20)]
HEAD_SHAPES = [(4, 4, 16), (8, 2, 32), (6, 3, 24)]  # GQA groups 1, 4 and 2; D not a power of 2


def make_step(
    layout: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int, dtype, seed: int
) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A mixed step over scattered pages: (meta, q, k, v, kv cache) with the prefixes cached."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + n) // BLOCK) for c, n in layout) + 3
    cache = torch.zeros(2, num_blocks, BLOCK, kv_heads, head_dim, dtype=dtype)
    free = torch.randperm(num_blocks, generator=gen).tolist()
    seqs, new_kv = [], {}
    for i, (cached, new) in enumerate(layout):
        table = [free.pop() for _ in range(-(-(cached + new) // BLOCK))]
        kv = torch.randn(2, cached + new, kv_heads, head_dim, generator=gen).to(dtype)
        for pos in range(cached):
            cache[:, table[pos // BLOCK], pos % BLOCK] = kv[:, pos]
        seqs.append(ScheduledSeq(f"s{i}", [0] * new, cached, table, RowSampling()))
        new_kv[f"s{i}"] = kv[:, cached:]
    batch = prepare_batch(StepPlan(1, seqs), BLOCK, DEVICE)
    # The batch puts one-token sequences first: stack the new K/V in that order,
    # as strided views of one fused [T, Hq + 2 * Hkv, D] tensor like the model's.
    order = [s for s in seqs if s.num_tokens == 1] + [s for s in seqs if s.num_tokens > 1]
    k, v = torch.cat([new_kv[s.request_id] for s in order], dim=1)
    q = torch.randn(k.shape[0], heads, head_dim, generator=gen).to(dtype)
    qkv = torch.cat([q, k, v], dim=1).to(DEVICE)
    q, k, v = qkv.split([heads, kv_heads, kv_heads], dim=1)
    return batch.meta, q, k, v, cache.to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_fills_pages_like_the_reference(dtype) -> None:
    meta, _, k, v, cache = make_step(LAYOUT, 4, 2, 24, dtype, seed=1)
    want = cache.clone()
    torch_ref.write_kv(k, v, want[0], want[1], meta.slot_mapping)
    kv_cache.write_kv(k, v, cache[0], cache[1], meta.slot_mapping)
    assert torch.equal(cache, want)
    # A negative slot is padding: that token is not written anywhere.
    slots = meta.slot_mapping.clone()
    slots[0] = -1
    fresh = torch.zeros_like(cache)
    kv_cache.write_kv(k, v, fresh[0], fresh[1], slots)
    assert torch.equal(fresh.flatten(1, 2)[:, slots[1:]], want.flatten(1, 2)[:, slots[1:]])
    assert int(fresh.count_nonzero()) == int(want.flatten(1, 2)[:, slots[1:]].count_nonzero())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), HEAD_SHAPES)
def test_triton_backend_matches_torch_backend(
    dtype, heads: int, kv_heads: int, head_dim: int
) -> None:
    meta, q, k, v, cache = make_step(LAYOUT, heads, kv_heads, head_dim, dtype, seed=heads)
    scale = head_dim**-0.5
    ref_cache = cache.clone()
    want = select_backend("torch", DEVICE)(heads, kv_heads, head_dim, scale).forward(
        q, k, v, ref_cache[0], ref_cache[1], meta
    )
    got = select_backend("triton", DEVICE)(heads, kv_heads, head_dim, scale).forward(
        q, k, v, cache[0], cache[1], meta
    )
    assert_close(got, want, dtype)
    assert torch.equal(cache, ref_cache)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), HEAD_SHAPES[1:])
def test_split_k_decode_matches_reference(dtype, heads: int, kv_heads: int, head_dim: int) -> None:
    # Contexts of 1 to 200 positions in partitions of 64: from one partition to
    # four, so the combine sees sequences with different partition counts.
    layout = [(0, 1), (63, 1), (64, 1), (100, 1), (199, 1), (BLOCK - 1, 1)]
    meta, q, k, v, cache = make_step(layout, heads, kv_heads, head_dim, dtype, seed=7)
    torch_ref.write_kv(k, v, cache[0], cache[1], meta.slot_mapping)
    scale = head_dim**-0.5
    reference = torch_ref.TorchAttention(heads, kv_heads, head_dim, scale)
    want = torch.empty_like(q)
    reference.decode(q, cache[0], cache[1], meta, want)
    for partition_size in (64, 128):
        got = decode_attention.paged_decode_attention(
            q,
            cache[0],
            cache[1],
            meta.decode_block_tables,
            meta.decode_seq_lens,
            meta.max_decode_seq_len,
            scale,
            partition_size=partition_size,
        )
        assert_close(got, want, dtype)


@pytest.mark.parametrize(
    ("seqs", "kv_heads", "max_len", "want"),
    [
        (1, 8, 32768, 1024),  # 8 programs: split in 32 to fill 132 SMs twice over
        (64, 8, 4096, 4096),  # 512 programs fill the GPU already: no split
        (1, 8, 200, 256),  # too short to be worth a split
        (1, 1, 1_000_000, 15680),  # capped at 64 partitions
    ],
)
def test_partition_size_heuristic(monkeypatch, seqs: int, kv_heads: int, max_len: int, want: int):
    monkeypatch.setattr(decode_attention, "multiprocessor_count", lambda device: 132)
    size = decode_attention.choose_partition_size(seqs, kv_heads, max_len, DEVICE)
    assert size == want
    assert size % decode_attention.PARTITION_ALIGN == 0
    assert -(-max_len // size) <= decode_attention.MAX_PARTITIONS


# -- selection and wiring ------------------------------------------------------


def test_selection() -> None:
    assert select_kernels("triton", DEVICE).name == "triton"
    assert select_kernels("auto", DEVICE).name == ("triton" if DEVICE.type == "cuda" else "cpu")
    assert select_backend("triton", DEVICE).name == "triton"
    assert set(KERNEL_OPS) >= {"torch", "triton"}
    from pdserve.core.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="kernel_backend"):
        select_kernels("cutlass", DEVICE)


class _Recording(TorchKernels):
    """The torch ops, counting which ones the layers called."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def rms_norm_residual(self, *args):  # type: ignore[no-untyped-def]
        self.calls.append("rms_norm_residual")
        return super().rms_norm_residual(*args)

    def silu_and_mul(self, *args):  # type: ignore[no-untyped-def]
        self.calls.append("silu_and_mul")
        return super().silu_and_mul(*args)

    def rotate(self, *args):  # type: ignore[no-untyped-def]
        self.calls.append("rotate")
        return super().rotate(*args)

    def route(self, *args):  # type: ignore[no-untyped-def]
        self.calls.append("route")
        return super().route(*args)


def test_layers_run_the_ops_they_were_built_with(reference_models) -> None:
    """The ops chosen for a model reach every fused layer; nothing else changes them."""
    from pdserve.models.families import build_model

    config = ModelConfig.from_dir(reference_models("mixtral"))
    ops = _Recording()
    backend = select_backend("torch", torch.device("cpu"))
    model = build_model(
        config, SINGLE_RANK_CTX, torch.float32, (0, config.num_layers), backend, ops
    )
    layer = model.layers[0]
    assert layer.input_norm.ops is ops and layer.attn.ops is ops and layer.mlp.ops is ops
    x = torch.randn(3, config.hidden_size)
    layer.input_norm(x)
    layer.mlp(x)
    cos, sin = torch.ones(3, 1, config.head_dim // 2), torch.zeros(3, 1, config.head_dim // 2)
    layer.attn.ops.rotate(torch.randn(3, 2, config.head_dim), cos, sin)
    assert (
        ops.calls[0] == "rms_norm_residual" and "route" in ops.calls and "silu_and_mul" in ops.calls
    )
    # A model built without ops computes with the torch reference.
    plain = build_model(config, SINGLE_RANK_CTX, torch.float32, (0, config.num_layers), backend)
    assert plain.layers[0].input_norm.ops is reference_kernels()


# -- the whole engine ----------------------------------------------------------


@pytest.mark.parametrize("name", ["llama", "mixtral"])
def test_engine_on_triton_kernels_matches_transformers(
    reference_models, monkeypatch, name: str
) -> None:
    from pdserve import LLM, SamplingParams
    from pdserve.kernels.attention import triton as triton_attention

    launched: set[str] = set()

    def spy(module: object, op: str) -> None:
        real = getattr(module, op)

        def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            launched.add(op)
            return real(*args, **kwargs)

        monkeypatch.setattr(module, op, counted)

    spies = [
        (norm, "rms_norm_residual"),
        (activation, "silu_and_mul"),
        (rotary, "rotate"),
        (routing, "route"),
        (triton_attention, "write_kv"),
        (triton_attention, "paged_decode_attention"),
        (triton_attention, "paged_prefill_attention"),
    ]
    for module, op in spies:
        spy(module, op)
    folder = reference_models(name)
    prompts = parity_prompts(ModelConfig.from_dir(folder).vocab_size)
    # One token, a chunk over two blocks, and a prompt cut into two chunks.
    prompts = [prompts[6], prompts[5], prompts[0][:40]]
    max_tokens = 4
    reference = hf_greedy(folder, prompts, max_new_tokens=max_tokens)
    llm = LLM(
        str(folder),
        attention_backend="triton",
        kernel_backend="triton",
        device=DEVICE.type,
        dtype="float32",
        block_size=16,
        max_num_batched_tokens=32,
    )
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    outputs = llm.generate(prompts, greedy)
    assert [o.outputs[0].token_ids for o in outputs] == reference
    # Every layer op ran on its Triton kernel (routing only in the MoE model).
    assert launched == {n for _, n in spies} - ({"route"} if name == "llama" else set())
    llm.engine.assert_idle()
