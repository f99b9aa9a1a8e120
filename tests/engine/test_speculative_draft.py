"""Speculative decoding with a draft model: same tokens as one token a step, drafts accepted."""

from __future__ import annotations

import json
import shutil
import time
from collections import Counter
from pathlib import Path

import pytest

from pdserve import LLM, SamplingParams
from pdserve.core.config import SpeculativeConfig, build_engine_config
from pdserve.core.errors import InvalidArgumentError
from pdserve.core.request import Request
from pdserve.engine.draft import PENDING, DraftProposer, DraftRow, ModelDrafter
from pdserve.engine.speculative import Speculator, best_draft_length
from tests.engine.test_speculative import (
    FAMILIES,
    GREEDY,
    _chi_square_ok,
    _same,
    _tokens,
    preempted_twice,
)
from tests.reference import _COMMON, ReferenceSpec, build_reference_model

PYCODE = dict(
    speculative_method="draft",
    speculative_draft_model="builtin:pycode-draft",
    speculative_min_acceptance=0.0,  # always draft: these tests check the tokens
)


def _draft(model: str | Path, **more: object) -> dict[str, object]:
    return dict(
        speculative_method="draft",
        speculative_draft_model=str(model),
        speculative_max_batch=64,
        **more,
    )


def _stats(llm: LLM):
    return llm.engine.scheduler.spec.stats


@pytest.fixture(scope="module")
def tiny_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer random Llama with the reference models' tokenizer and vocabulary."""
    folder = tmp_path_factory.mktemp("draft")
    spec = ReferenceSpec("llama", seed=7, options=dict(_COMMON, num_hidden_layers=1))
    build_reference_model(spec, folder)
    return folder


# -- configuration -------------------------------------------------------------


def test_bad_configurations_name_the_draft_model() -> None:
    config = build_engine_config("m", speculative_method="draft", speculative_draft_model="d")
    assert config.speculative == SpeculativeConfig(method="draft", draft_model="d")
    with pytest.raises(InvalidArgumentError, match="speculative_draft_model"):
        build_engine_config("m", speculative_method="draft")
    with pytest.raises(InvalidArgumentError, match="speculative_draft_model"):
        build_engine_config("m", speculative_method="ngram", speculative_draft_model="d")
    with pytest.raises(InvalidArgumentError, match=r"speculative_draft_model.*pipeline"):
        build_engine_config(
            "m", speculative_method="draft", speculative_draft_model="d", pipeline_parallel_size=2
        )
    with pytest.raises(InvalidArgumentError, match="speculative_draft_model"):
        Speculator(SpeculativeConfig(method="draft", draft_model="d"))  # no draft model loaded


def test_a_draft_of_another_vocabulary_is_refused(references, tmp_path: Path) -> None:
    folder, _, _ = references("llama")
    with pytest.raises(InvalidArgumentError, match=r"speculative_draft_model.*vocabulary"):
        LLM("builtin:pycode", **_draft(folder))
    # Same size, two ids swapped: the tokenizers disagree.
    other = tmp_path / "swapped"
    shutil.copytree(folder, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[40:42]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(InvalidArgumentError, match=r"speculative_draft_model.*other ids"):
        LLM(str(folder), **_draft(other))


# -- what the draft model reads --------------------------------------------------


class _Recorder(DraftProposer):
    def __init__(self) -> None:
        self.rows: list[DraftRow] = []

    @property
    def max_positions(self) -> int:
        return 100

    def propose(self, rows: list[DraftRow]) -> list[list[int]]:
        self.rows.extend(rows)
        return [[5] * r.num_drafts for r in rows]


def test_the_draft_reads_each_token_once_and_again_after_preemption() -> None:
    recorder = _Recorder()
    drafter = ModelDrafter(recorder)
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=50))

    def fill() -> DraftRow:
        out = drafter.fill({"r": [-1, -1]}, [request], lambda rid: [0, 1])
        assert out == {"r": [5, 5]}
        return recorder.rows[-1]

    first = fill()
    assert (first.token_ids, first.start_pos, first.num_drafts) == ([1, 2, 3], 0, 2)
    request.append_token(8)
    request.append_token(9)  # the verify kept one draft and added one token
    assert (fill().token_ids, recorder.rows[-1].start_pos) == ([8, 9], 3)
    request.num_preemptions += 1  # its blocks went back to the pool
    assert (fill().token_ids, recorder.rows[-1].start_pos) == ([1, 2, 3, 8, 9], 0)
    assert drafter.limit(request) == 100 - 5 + 1
    drafter.forget("r")
    assert fill().start_pos == 0


class _Slow(_Recorder):
    """A proposer whose call takes ``seconds`` (a draft model that costs that much)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    def propose(self, rows: list[DraftRow]) -> list[list[int]]:
        time.sleep(self.seconds)
        return super().propose(rows)


def test_the_best_draft_length_weighs_acceptance_against_cost() -> None:
    # j drafts yield 1 + a + ... + a^j tokens for 1 + j * cost plain steps.
    assert best_draft_length(0.9, 4, 0.05) == 4
    assert best_draft_length(0.8, 4, 0.3) == 3  # 2.95 / 1.9 beats 3.36 / 2.2 and 2.44 / 1.6
    assert best_draft_length(0.5, 4, 0.5) == 0  # 1.5 / 1.5: one draft only breaks even
    assert best_draft_length(0.0, 4, 0.0) == 0


def _drafting_step(spec: Speculator, request: Request, seconds: float) -> None:
    slots = spec.propose(request, 4, 100)
    if slots:
        spec.fill({request.request_id: slots}, [request], lambda rid: [0, 1])
    spec.observe_step(seconds)


def test_a_request_drafts_as_many_tokens_as_pay_and_none_when_none_do() -> None:
    config = SpeculativeConfig(method="draft", draft_model="x", num_speculative_tokens=2)
    spec = Speculator(config, _Slow(0.02))
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=500))
    assert spec.propose(request, 2, 100) == [PENDING, PENDING]  # nothing timed yet
    _drafting_step(spec, request, 0.02)  # two passes in >= 20 ms: each half a 20 ms step
    assert spec.draft_cost >= 0.5  # no plain step timed yet: a draft costs its pass
    for _ in range(12):  # every first draft rejected
        spec.record("r", 2, 0)
    assert spec.propose(request, 2, 100) == []
    # Drafting does not pay on this instance: a new request starts from what it learned
    # and drafts nothing, but one row in 32 that drafts nothing probes with one draft.
    fresh = Request("s", [1, 2, 3], SamplingParams(max_tokens=500))
    tries = [spec.propose(fresh, 2, 100) for _ in range(64)]
    assert tries.count([PENDING]) == 1 and tries.count([]) == 63

    cheap = Speculator(config, _Slow(0.0))
    for _ in range(20):  # a plain step of 10 ms; verifying two drafts costs 5 ms more
        cheap.observe_step(0.01)
        cheap.fill({"r": [PENDING, PENDING]}, [request], lambda rid: [0, 1])
        cheap.observe_step(0.015)
    assert 0.24 <= cheap.draft_cost < 0.3  # (2.5 ms a draft + a pass of ~0) / 10 ms
    for _ in range(12):  # the first draft kept, the second rejected: a = 0.5
        cheap.record("r", 2, 1)
    # One draft: 1.5 tokens for 1.25 steps (1.2x); two: 1.75 for 1.5 (1.17x).
    assert cheap.propose(request, 2, 100) == [PENDING]
    for _ in range(12):
        cheap.record("r", 2, 2)
    assert cheap.propose(request, 2, 100) == [PENDING, PENDING]


# -- token identity ------------------------------------------------------------------


@pytest.mark.parametrize("name", FAMILIES)
def test_greedy_is_token_identical(name: str, references, tiny_draft: Path) -> None:
    """A random one-layer draft (mostly rejected) and the model as its own draft (all kept)."""
    folder, prompts, reference = references(name)
    for draft in (tiny_draft, folder):
        on = LLM(str(folder), max_num_batched_tokens=64, block_size=16, **_draft(draft))
        assert _tokens(on.generate(prompts, GREEDY)) == reference
        stats = _stats(on)
        assert stats.proposed > 0
        on.check_idle()
    # Its own draft agrees with it up to float noise between batch shapes.
    assert stats.acceptance_rate > 0.9, stats


def test_preemption_and_prefix_hits_keep_the_tokens(references) -> None:
    """A preempted request's draft reads its tokens again from its new blocks."""
    folder, _, _ = references("llama")
    assert _stats(preempted_twice(references, **_draft(folder))).acceptance_rate > 0.9


@pytest.fixture(scope="module")
def pycode() -> tuple[LLM, LLM, list[list[int]]]:
    on = LLM("builtin:pycode", max_model_len=512, **PYCODE)
    off = LLM("builtin:pycode", max_model_len=512)
    assert on.tokenizer is not None
    code = [
        "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef ",
        "import os\nimport sys\nimport re\nimport json\nimport ",
        "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
        'def main():\n    """Run the program."""\n    parser = argparse.ArgumentParser()\n',
    ]
    return on, off, [on.tokenizer.encode(c) for c in code]


def test_pycode_with_its_draft_is_token_identical(pycode) -> None:
    on, off, prompts = pycode
    _same(on, off, prompts, SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))
    stats = _stats(on)
    assert stats.accepted > 0 and stats.proposed > stats.accepted
    for n in (1, 2, 7):
        _same(on, off, prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    limited = LLM("builtin:pycode", max_model_len=48, **PYCODE)
    free = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    out = _same(limited, LLM("builtin:pycode", max_model_len=48), prompts, free)
    assert all(o.outputs[0].finish_reason == "length" for o in out)


def test_seeded_sampling_is_token_identical(pycode) -> None:
    on, off, prompts = pycode
    params = [
        SamplingParams(max_tokens=32, temperature=t, top_k=k, seed=s, ignore_eos=True)
        for t, k, s in [(0.3, -1, 1), (0.7, 20, 2), (1.0, 5, 3), (0.5, -1, 4)]
    ]
    verified = _stats(on).steps
    assert _tokens(on.generate(prompts, params)) == _tokens(off.generate(prompts, params))
    assert _stats(on).steps > verified  # sampled rows verified drafts
    on.check_idle()


def test_sampled_output_keeps_the_target_distribution() -> None:
    """Unseeded draws with and without the draft model: same token frequencies."""
    on = LLM("builtin:pycode", max_num_seqs=256, seed=1, speculative_max_batch=256, **PYCODE)
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
    assert _chi_square_ok(Counter(tuple(t) for t in got), Counter(tuple(t) for t in want))
    on.check_idle()


def test_large_batches_and_low_acceptance_turn_it_off(references, tiny_draft: Path) -> None:
    folder, prompts, reference = references("llama")
    small = LLM(str(folder), **{**_draft(folder), "speculative_max_batch": 2})
    assert _tokens(small.generate(prompts, GREEDY)) == reference
    assert _stats(small).skipped_batches > 0 and _stats(small).proposed == 0
    long = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    eager = LLM(str(folder), **_draft(tiny_draft, speculative_min_acceptance=0.0))
    picky = LLM(str(folder), **_draft(tiny_draft, speculative_min_acceptance=0.9))
    assert _tokens(picky.generate(prompts[:4], long)) == _tokens(eager.generate(prompts[:4], long))
    # A random draft is mostly rejected: requests draft only on probe steps.
    assert _stats(picky).proposed < _stats(eager).proposed / 2
    picky.check_idle()


# -- instances of several ranks ----------------------------------------------------------


def test_tensor_parallel_instance_gives_the_same_tokens(ray_session, references) -> None:
    """With tp=2 the draft model runs on the leader rank only."""
    folder, prompts, reference = references("llama")
    llm = LLM(str(folder), tensor_parallel_size=2, num_cpus_per_rank=0.5, **_draft(folder))
    try:
        assert _tokens(llm.generate(prompts, GREEDY)) == reference
        llm.check_idle()
    finally:
        llm.shutdown()


def test_decode_instance_drafts_after_the_hand_off(ray_session, references) -> None:
    """The prompt's KV comes from the prefill instance; the draft reads the prompt itself."""
    from pdserve.core.config import DisaggregationConfig

    folder, prompts, reference = references("llama")
    llm = LLM(
        str(folder),
        disaggregated=True,
        connector="shm",
        num_cpus_per_rank=0.5,
        decode=_draft(folder),
        disaggregation=DisaggregationConfig(local_prefill_max_tokens=2),
    )
    try:
        assert _tokens(llm.generate(prompts, GREEDY)) == reference
        llm.check_idle()
        spec = ray_session.get(llm.backend.decode.leader.stats.remote()).speculation
        assert spec is not None and spec.accepted > 0.9 * spec.proposed > 0, spec
    finally:
        llm.shutdown()
