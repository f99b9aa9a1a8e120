"""Structured output: rows with a JSON schema give JSON that the schema validates
(checked with ``jsonschema``) and then stop, greedy or sampled, beside free rows
that the grammar leaves alone; through preemption, with speculative decoding on,
and across two pipeline stages."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pdserve import LLM, SamplingParams
from pdserve.core.errors import InvalidArgumentError
from tests.engine.speculation import SPEC

SCHEMA = {
    "type": "object",
    "properties": {
        "colour": {"enum": ["red", "green", "blue"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["colour", "ok", "tags"],
    "additionalProperties": False,
}
TEXT = json.dumps(SCHEMA)


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=64, temperature=0, json_schema=TEXT),
        SamplingParams(max_tokens=64, temperature=1.0, seed=5, json_schema=TEXT),
        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
    ]


def test_schema_rows_give_valid_json_and_stop_beside_free_rows(references) -> None:
    folder, prompts, _ = references("llama")
    llm = LLM(str(folder), max_num_batched_tokens=64, block_size=16)
    params = _params()
    outs = llm.generate(prompts[:3], params)
    for o in outs[:2]:
        assert o.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
    (alone,) = llm.generate(prompts[2:3], params[2])
    assert outs[2].outputs[0].token_ids == alone.outputs[0].token_ids  # the free row: untouched
    with pytest.raises(json.JSONDecodeError):
        json.loads(alone.outputs[0].text)  # (this model does not write JSON by itself)
    llm.check_idle()


def test_preempted_and_speculative_schema_rows_give_the_same_json(references) -> None:
    folder, prompts, _ = references("llama")
    params = [_params()[i % 3] for i in range(len(prompts))]
    roomy = LLM(str(folder), block_size=16, max_num_batched_tokens=128)
    outs = roomy.generate(prompts, params)
    for o, p in zip(outs, params, strict=True):
        if p.json_schema is not None:
            jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
    want = [o.outputs[0].token_ids for o in outs]
    tight = LLM(str(folder), num_blocks=24, block_size=16, max_num_batched_tokens=128)
    assert [o.outputs[0].token_ids for o in tight.generate(prompts, params)] == want
    assert tight.engine.scheduler.num_preemptions > 0
    spec = LLM(str(folder), max_num_batched_tokens=128, block_size=16, **SPEC)
    repetitive = [p[:12] * 3 for p in prompts[:6]]
    got = spec.generate(repetitive, params[:6])
    plain = roomy.generate(repetitive, params[:6])
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    assert spec.engine.scheduler.spec.stats.accepted > 0  # the free rows verified drafts
    for llm in (roomy, tight, spec):
        llm.generate(prompts[:1], params[2])  # a step that carries the last finished ids
        assert len(llm.engine.executor.runner.sampler.grammars) == 0
        llm.check_idle()


@pytest.mark.parametrize(
    ("schema", "why"),
    [
        ("{not json", "is not JSON"),
        ("[1, 2]", "must be a JSON object"),
        ('{"type": "nonsense"}', "cannot guide decoding"),
        (7, "must be JSON text"),
    ],
)
def test_bad_schemas_are_refused_by_name(schema: object, why: str) -> None:
    with pytest.raises(InvalidArgumentError, match="json_schema") as e:
        SamplingParams(json_schema=schema)  # type: ignore[arg-type]
    assert why in str(e.value)
    with pytest.raises(InvalidArgumentError, match="min_tokens"):
        SamplingParams(json_schema=TEXT, min_tokens=3)
