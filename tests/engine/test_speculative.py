"""Speculative decoding (prompt lookup): same tokens as one token a step, fewer steps."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from pdserve import LLM, SamplingParams
from pdserve.core.config import SpeculativeConfig, build_engine_config
from pdserve.core.errors import InvalidArgumentError
from pdserve.engine.speculative import propose_ngram
from tests.engine.speculation import SPEC
from tests.reference import MAX_NEW_TOKENS

FAMILIES = ["llama", "llama_untied", "qwen2", "mixtral"]
GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0, ignore_eos=True)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _stats(llm: LLM):
    return llm.engine.scheduler.spec.stats


def test_propose_ngram_takes_the_latest_longest_match() -> None:
    #            0  1  2  3  4  5  6  7  8  9
    tokens = [1, 2, 3, 9, 1, 2, 3, 4, 5, 1, 2, 3]
    assert propose_ngram(tokens, 2, 1, 3) == [4, 5]  # "1 2 3" last seen at 4
    assert propose_ngram(tokens, 9, 1, 3) == [4, 5, 1, 2, 3]
    assert propose_ngram([7, 8, 9], 4, 1, 3) == []
    assert propose_ngram([5, 6, 5], 4, 2, 3) == []  # only a 1-gram recurs
    assert propose_ngram([5, 6, 5], 4, 1, 3) == [6, 5]


def test_config_is_checked_and_wired() -> None:
    config = build_engine_config("m", speculative_method="ngram", num_speculative_tokens=3)
    assert config.speculative == SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    with pytest.raises(InvalidArgumentError, match="speculative_method"):
        build_engine_config("m", speculative_method="medusa")
    with pytest.raises(InvalidArgumentError, match="num_speculative_tokens"):
        build_engine_config("m", speculative_method="ngram", num_speculative_tokens=0)
    with pytest.raises(InvalidArgumentError, match="prompt_lookup_max"):
        SpeculativeConfig(prompt_lookup_min=3, prompt_lookup_max=2)


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_is_token_identical(name: str, references) -> None:
    folder, prompts, reference = references(name)
    on = LLM(str(folder), max_num_batched_tokens=64, block_size=16, **SPEC)
    assert _tokens(on.generate(prompts, GREEDY)) == reference
    on.check_idle()
    # Repetitive prompts, longer outputs: drafts are proposed and some accepted.
    repetitive = [p[:12] * 3 for p in prompts[:6]]
    longer = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    off = LLM(str(folder), max_num_batched_tokens=64, block_size=16)
    accepted = _stats(on).accepted
    assert _tokens(on.generate(repetitive, longer)) == _tokens(off.generate(repetitive, longer))
    assert _stats(on).accepted > accepted
    assert _stats(on).proposed > _stats(on).accepted  # rejections were rolled back too
    on.check_idle()
    off.check_idle()


def preempted_twice(references, **speculation: object) -> LLM:
    """Repetitive llama prompts on a small cache (preemptions), run twice (the second
    time, prompts and outputs are prefix-cache hits): each run's tokens equal those of
    decoding one token a step. Returns the speculating engine."""
    folder, prompts, _ = references("llama")
    repetitive = [p[:12] * 3 for p in prompts[:6]]
    longer = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    want = _tokens(LLM(str(folder)).generate(repetitive, longer))
    on = LLM(str(folder), num_blocks=30, block_size=4, max_num_batched_tokens=128, **speculation)
    for _ in range(2):
        assert _tokens(on.generate(repetitive, longer)) == want
        on.check_idle()
    assert on.engine.scheduler.num_preemptions > 0
    assert on.engine.kv.stats.hits > 0
    return on


def test_preemption_and_prefix_hits_keep_the_tokens(references) -> None:
    """Drafted KV past the accepted tokens is never cached or reused as valid."""
    assert _stats(preempted_twice(references, **SPEC)).accepted > 0


@pytest.fixture(scope="module")
def pycode() -> tuple[LLM, LLM, list[list[int]]]:
    on = LLM("builtin:pycode", max_model_len=512, **SPEC)
    off = LLM("builtin:pycode", max_model_len=512)
    assert on.tokenizer is not None
    code = [
        "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef ",
        "import os\nimport sys\nimport re\nimport json\nimport ",
        "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
        "for i in range(10):\n    print(i)\nfor j in range(10):\n    print(j)\n",
    ]
    return on, off, [on.tokenizer.encode(c) for c in code]


def _same(on: LLM, off: LLM, prompts: list[list[int]], params: SamplingParams) -> list:
    got, want = on.generate(prompts, params), off.generate(prompts, params)
    for g, w in zip(got, want, strict=True):
        gc, wc = g.outputs[0], w.outputs[0]
        assert (gc.token_ids, gc.text, gc.finish_reason, gc.stop_reason) == (
            wc.token_ids,
            wc.text,
            wc.finish_reason,
            wc.stop_reason,
        )
    on.check_idle()
    return want


def test_stops_cut_where_one_token_steps_would(pycode) -> None:
    on, off, prompts = pycode
    free = _same(on, off, prompts, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    assert _stats(on).accepted > 0
    for n in (1, 2, 7, 13):
        _same(on, off, prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    # A stop token and a stop string taken from the middle of each output.
    for out, prompt in zip(free, prompts, strict=True):
        ids, text = out.outputs[0].token_ids, out.outputs[0].text
        for params in (
            SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[ids[len(ids) // 2]]),
            SamplingParams(max_tokens=40, temperature=0, stop=[text[len(text) // 2 :][:3]]),
            SamplingParams(
                max_tokens=40,
                temperature=0,
                stop=[text[len(text) // 3 :][:2]],
                include_stop_str_in_output=True,
            ),
            SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[ids[-1]], min_tokens=5),
        ):
            _same(on, off, [prompt], params)


def test_context_limit_cuts_exactly(pycode) -> None:
    _, _, prompts = pycode
    on = LLM("builtin:pycode", max_model_len=48, **SPEC)
    off = LLM("builtin:pycode", max_model_len=48)
    out = _same(on, off, prompts, SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))
    assert all(o.outputs[0].finish_reason == "length" for o in out)
    assert _stats(on).accepted > 0


def test_seeded_sampling_is_token_identical(pycode) -> None:
    """Each position is sampled with the noise it gets without drafts: same tokens."""
    on, off, prompts = pycode
    params = [
        SamplingParams(max_tokens=32, temperature=t, top_k=k, seed=s, ignore_eos=True)
        for t, k, s in [(0.3, -1, 1), (0.7, 20, 2), (1.0, 5, 3), (0.5, -1, 4)]
    ]
    accepted = _stats(on).accepted
    got = _tokens(on.generate(prompts, params))
    assert got == _tokens(off.generate(prompts, params))
    assert _stats(on).accepted > accepted
    on.check_idle()


def _chi_square_ok(a: Counter, b: Counter) -> bool:
    """Two-sample chi-square homogeneity test at p = 0.001 (rare tokens pooled)."""
    n_a, n_b = sum(a.values()), sum(b.values())
    cats = [t for t in a.keys() | b.keys() if a[t] + b[t] >= 10]
    other_a = n_a - sum(a[t] for t in cats)
    other_b = n_b - sum(b[t] for t in cats)
    cells = [(a[t], b[t]) for t in cats] + ([(other_a, other_b)] if other_a + other_b else [])
    stat = 0.0
    for x, y in cells:
        total = x + y
        for observed, n in ((x, n_a), (y, n_b)):
            expected = total * n / (n_a + n_b)
            stat += (observed - expected) ** 2 / expected
    df = len(cells) - 1
    # Wilson-Hilferty: chi2 quantile at 0.999 (z = 3.09).
    bound = df * (1 - 2 / (9 * df) + 3.09 * math.sqrt(2 / (9 * df))) ** 3
    return stat < bound


def test_sampled_output_keeps_the_target_distribution() -> None:
    """Unseeded draws with and without drafts: same token frequencies per position."""
    on = LLM("builtin:pycode", max_num_seqs=256, seed=1, **{**SPEC, "speculative_max_batch": 256})
    off = LLM("builtin:pycode", max_num_seqs=256, seed=2)
    assert on.tokenizer is not None
    prompt = on.tokenizer.encode("import os\nimport sys\n" * 3 + "import")
    params = SamplingParams(max_tokens=4, temperature=1.3, top_k=8, ignore_eos=True)
    n = 1000
    got = _tokens(on.generate([prompt] * n, params))
    want = _tokens(off.generate([prompt] * n, params))
    stats = _stats(on)
    assert stats.accepted > 100 and stats.proposed - stats.accepted > 20
    for pos in range(1, 4):
        a = Counter(t[pos] for t in got)
        b = Counter(t[pos] for t in want)
        assert _chi_square_ok(a, b), (pos, a.most_common(6), b.most_common(6))
    # The joint law of the drafted positions, too.
    assert _chi_square_ok(Counter(tuple(t) for t in got), Counter(tuple(t) for t in want))
    on.check_idle()


def test_low_acceptance_and_large_batches_turn_it_off(references) -> None:
    folder, prompts, _ = references("llama")
    small = LLM(str(folder), speculative_method="ngram", speculative_max_batch=2)
    small.generate(prompts, GREEDY)  # ten requests decode together: no drafts
    assert _stats(small).skipped_batches > 0
    assert _stats(small).proposed == 0
    picky = LLM(str(folder), **SPEC, speculative_min_acceptance=1.0)
    repetitive = [p[:12] * 3 for p in prompts[:6]]
    long = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    eager = LLM(str(folder), **SPEC)
    assert _tokens(picky.generate(repetitive, long)) == _tokens(eager.generate(repetitive, long))
    # One rejection and a request drafts only on probe steps.
    assert _stats(picky).steps < _stats(eager).steps
    picky.check_idle()


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_multirank_instance_gives_the_same_tokens(ray_session, references, tp, pp) -> None:
    """Every rank runs the verifying rows; with pp the sampler rank sends padded rows."""
    folder, prompts, reference = references("llama")
    repetitive = [p[:12] * 3 for p in prompts[:4]]
    longer = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    one = LLM(str(folder), **SPEC)
    want = _tokens(one.generate(repetitive, longer))
    assert _stats(one).accepted > 0
    llm = LLM(
        str(folder),
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        num_cpus_per_rank=0.5,
        **SPEC,
    )
    try:
        assert _tokens(llm.generate(prompts, GREEDY)) == reference
        assert _tokens(llm.generate(repetitive, longer)) == want
        llm.check_idle()
    finally:
        llm.shutdown()


def test_decode_instance_speculates(ray_session, references) -> None:
    """A decode instance drafts after the hand-off; the pair gives the plain tokens."""
    from pdserve.core.config import DisaggregationConfig

    folder, prompts, reference = references("llama")
    repetitive = [p[:12] * 3 for p in prompts[:4]]
    longer = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    want = _tokens(LLM(str(folder)).generate(repetitive, longer))
    llm = LLM(
        str(folder),
        disaggregated=True,
        connector="shm",
        num_cpus_per_rank=0.5,
        decode=SPEC,
        disaggregation=DisaggregationConfig(local_prefill_max_tokens=2),
    )
    try:
        assert _tokens(llm.generate(prompts, GREEDY)) == reference
        assert _tokens(llm.generate(repetitive, longer)) == want
        llm.check_idle()
    finally:
        llm.shutdown()


def test_the_counters_reach_the_metrics(references) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from pdserve.core.snapshot import ClusterSnapshot, InstanceCounters, SnapshotCollector

    folder, prompts, _ = references("llama")
    llm = LLM(str(folder), **SPEC)
    llm.generate([p[:12] * 3 for p in prompts[:2]], GREEDY)
    counters = llm.engine.spec_counters()
    stats = _stats(llm)
    assert counters is not None and counters.proposed == stats.proposed > 0
    assert (counters.accepted, counters.verify_steps) == (stats.accepted, stats.steps)
    assert LLM(str(folder)).engine.spec_counters() is None, "off: nothing to report"
    collector = SnapshotCollector()
    collector.snapshot = ClusterSnapshot(
        0.0, [], [InstanceCounters("d0", "east", "decode", speculation=counters)]
    )
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    assert (
        f'pdserve_spec_accepted_tokens_total{{instance="d0",region="east",role="decode"}} {float(counters.accepted)}'
        in text
    )
