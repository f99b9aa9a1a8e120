"""JSON schemas as grammars for structured output (llguidance, imported when used).

The sampling rank masks logits with the grammar (``parallel/grammar.py``); the
front doors and :class:`~pdserve.core.sampling_params.SamplingParams` check a
schema here first, so a schema that cannot guide decoding is refused by name
before it reaches an engine.
"""

from __future__ import annotations

import json


def grammar(schema: str) -> str:
    """The llguidance grammar of a JSON schema (text), compact: no free whitespace."""
    from llguidance import LLMatcher

    # no free whitespace unless the schema's "x-guidance" asks for it
    compact = {"whitespace_flexible": False}
    return str(LLMatcher.grammar_from_json_schema(json.loads(schema), defaults=compact))  # type: ignore[arg-type]


def check_schema(schema: str) -> str | None:
    """Why a JSON schema cannot guide decoding (None: it can)."""
    from llguidance import LLMatcher

    try:
        text = grammar(schema)
    except ValueError as e:
        return str(e)
    error = LLMatcher.validate_grammar(text)
    return error or None
