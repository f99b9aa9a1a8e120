"""Sampler: greedy, temperature, top-k / top-p exclusion, per-request seeds."""

from __future__ import annotations

import torch

from pdserve.core.step import RowSampling
from pdserve.parallel.sampler import Sampler


def test_greedy_takes_the_argmax() -> None:
    logits = torch.tensor([[0.1, 3.0, -1.0], [5.0, 4.9, 0.0]])
    assert Sampler()(logits, [RowSampling(), RowSampling()]) == [1, 0]


def test_top_k_never_emits_a_token_outside_the_k_best() -> None:
    torch.manual_seed(0)
    logits = torch.randn(1, 50).repeat(400, 1)
    allowed = set(torch.topk(logits[0], 5).indices.tolist())
    rows = [RowSampling(temperature=2.0, top_k=5)] * 400
    tokens = Sampler(seed=1)(logits, rows)
    assert set(tokens) <= allowed
    assert len(set(tokens)) == 5  # and all five do occur at this temperature


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(2000, 1)
    tokens = Sampler(seed=2)(logits, [RowSampling(temperature=1.0, top_p=0.8)] * 2000)
    # 0.5 + 0.3 reaches 0.8: tokens 2 and 3 are cut.
    assert set(tokens) == {0, 1}
    share = tokens.count(0) / len(tokens)
    assert abs(share - 0.5 / 0.8) < 0.05


def test_top_k_and_top_p_combine() -> None:
    logits = torch.tensor([[4.0, 3.9, 3.8, 0.0, -1.0]]).repeat(500, 1)
    tokens = Sampler(seed=3)(logits, [RowSampling(temperature=1.0, top_k=3, top_p=0.5)] * 500)
    assert set(tokens) <= {0, 1}


def test_sampling_follows_the_distribution() -> None:
    probs = torch.tensor([0.7, 0.2, 0.1])
    logits = probs.log().repeat(5000, 1)
    tokens = Sampler(seed=4)(logits, [RowSampling(temperature=1.0)] * 5000)
    counts = torch.bincount(torch.tensor(tokens), minlength=3).float() / 5000
    assert torch.allclose(counts, probs, atol=0.03)


def test_seeded_rows_ignore_their_batch_mates() -> None:
    torch.manual_seed(5)
    logits = torch.randn(3, 100)
    seeded = RowSampling(temperature=1.0, seed=42, output_index=7)
    alone = Sampler(seed=0)(logits[1:2], [seeded])[0]
    for engine_seed in (0, 1, 2):
        batch = Sampler(seed=engine_seed)(
            logits, [RowSampling(temperature=1.0), seeded, RowSampling(temperature=0.5)]
        )
        assert batch[1] == alone
    # Another position of the same request draws different noise.
    draws = {
        Sampler()(logits[1:2], [RowSampling(temperature=5.0, seed=42, output_index=i)])[0]
        for i in range(20)
    }
    assert len(draws) > 1


def test_banned_tokens_are_never_sampled() -> None:
    logits = torch.tensor([[10.0, 0.0, 0.0]]).repeat(100, 1)
    rows = [RowSampling(temperature=1.0, banned_token_ids=(0,))] * 100
    assert 0 not in Sampler()(logits, rows)
    assert Sampler()(logits[:1], [RowSampling(banned_token_ids=(0,))]) != [0]
