"""Re-sharding routes: every decode (layer, head) comes from exactly one prefill holder."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.core.config import ParallelConfig
from pdserve.core.layout import plan_layout
from pdserve.core.model_config import ModelConfig, RopeConfig
from pdserve.transfer.routes import kv_heads_of, plan_routes, routes_into


def model(kv_heads: int, heads: int = 8, layers: int = 4) -> ModelConfig:
    return ModelConfig(
        path="x",
        architecture="LlamaForCausalLM",
        family="llama",
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=8,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope=RopeConfig(),
        tie_word_embeddings=False,
        attention_bias=False,
        dtype="float32",
    )


def moe(kv_heads: int) -> ModelConfig:
    return dataclasses.replace(
        model(kv_heads),
        architecture="MixtralForCausalLM",
        family="mixtral",
        num_experts=4,
        num_experts_per_tok=2,
    )


def layout(m: ModelConfig, tp: int = 1, pp: int = 1, afd: tuple[int, int] | None = None):
    if afd is not None:  # (attention ranks, expert ranks)
        a, f = afd
        return plan_layout(m, ParallelConfig(afd=True, afd_attention_ranks=a, afd_expert_ranks=f))
    return plan_layout(m, ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp))


CASES = [
    (4, (2, 1), (1, 1)),  # TP=2 -> TP=1
    (4, (1, 1), (2, 1)),  # TP=1 -> TP=2
    (2, (1, 1), (4, 1)),  # KV heads replicated on the decode side
    (2, (4, 1), (1, 1)),  # ... and on the prefill side
    (4, (1, 2), (2, 1)),  # PP=2 -> TP=2
    (4, (2, 2), (1, 2)),  # TP2xPP2 -> PP=2
    (1, (2, 1), (2, 1)),  # one KV head everywhere
]


AFD_CASES = [
    (4, {}, {"afd": (1, 1)}),  # TP=1 -> afd 1+1
    (4, {"afd": (2, 1)}, {}),  # afd 2+1 -> TP=1
    (4, {"afd": (2, 2)}, {"afd": (1, 1)}),  # afd -> afd, other sizes
    (2, {"afd": (1, 2)}, {"afd": (4, 1)}),  # ... KV heads replicated on the decode side
    (4, {"pp": 2}, {"afd": (2, 1)}),  # PP=2 -> afd 2+1
]


@pytest.mark.parametrize(("kv", "src", "dst"), CASES)
def test_routes_cover_every_decode_slice_once(kv: int, src, dst) -> None:
    m = model(kv)
    _check_cover(kv, layout(m, *src), layout(m, *dst))


@pytest.mark.parametrize(("kv", "src", "dst"), AFD_CASES, ids=str)
def test_afd_expert_ranks_neither_send_nor_receive_kv(kv: int, src, dst) -> None:
    """Expert ranks hold no KV: no route starts or ends there, none is awaited there."""
    m = moe(kv)
    s, d = layout(m, **src), layout(m, **dst)
    routes = plan_routes(kv, s, d)
    assert routes
    assert not [r for r in routes if s.is_expert_rank(r.src_rank) or d.is_expert_rank(r.dst_rank)]
    for rank in range(d.world_size):
        if d.is_expert_rank(rank):
            assert kv_heads_of(kv, d, rank) == (0, 0) and routes_into(routes, rank) == 0
        else:
            assert routes_into(routes, rank) > 0
    _check_cover(kv, s, d)


def test_plain_to_afd_sends_every_head_to_the_attention_rank() -> None:
    m = moe(4)
    routes = plan_routes(4, layout(m, 2), layout(m, afd=(1, 1)))
    assert [(r.src_rank, r.dst_rank, r.heads, r.layers) for r in routes] == [
        (0, 0, (0, 2), (0, 4)),
        (1, 0, (2, 4), (0, 4)),
    ]


def _check_cover(kv: int, s, d) -> None:
    routes = plan_routes(kv, s, d)
    for rank in range(d.world_size):
        lo, hi = d.stage_layers[d.coords(rank).stage]
        heads = kv_heads_of(kv, d, rank)
        covered = {}
        for r in routes:
            if r.dst_rank != rank:
                continue
            # The source really holds what it sends.
            s_lo, s_hi = s.stage_layers[s.coords(r.src_rank).stage]
            assert s_lo <= r.layers[0] and r.layers[1] <= s_hi
            s_heads = kv_heads_of(kv, s, r.src_rank)
            assert s_heads[0] <= r.heads[0] and r.heads[1] <= s_heads[1]
            sh, dh = r.src_heads(), r.dst_heads()
            assert sh[1] - sh[0] == dh[1] - dh[0] == r.heads[1] - r.heads[0]
            for layer in range(*r.layers):
                for head in range(*r.heads):
                    assert (layer, head) not in covered, "sent twice"
                    covered[(layer, head)] = r.src_rank
        assert set(covered) == {(layer, h) for layer in range(lo, hi) for h in range(*heads)}
        assert routes_into(routes, rank) == len(
            {(r.src_rank, r.layers) for r in routes if r.dst_rank == rank}
        )


def test_tp2_to_tp1_splits_heads_by_source() -> None:
    m = model(4)
    routes = plan_routes(4, layout(m, 2), layout(m, 1))
    assert [(r.src_rank, r.heads, r.src_heads(), r.dst_heads()) for r in routes] == [
        (0, (0, 2), (0, 2), (0, 2)),
        (1, (2, 4), (0, 2), (2, 4)),
    ]
