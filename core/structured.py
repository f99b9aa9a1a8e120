"""JSON schemas as grammars for structured output (llguidance, imported when used).

The sampling rank masks logits with the grammar (``parallel/grammar.py``); the
front doors and :class:`~pdserve.core.sampling_params.SamplingParams` check a
schema here first, so a schema that cannot guide decoding is refused by name
before it reaches an engine.
"""

from __future__ import annotations

import functools
import json


def grammar(schema: str) -> str:
    """The llguidance grammar of a JSON schema (text), compact: no free whitespace."""
    from llguidance import LLMatcher

    # no free whitespace unless the schema's "x-guidance" asks for it
    compact = {"whitespace_flexible": False}
    return str(LLMatcher.grammar_from_json_schema(json.loads(schema), defaults=compact))  # type: ignore[arg-type]


@functools.lru_cache(maxsize=128)
def check_schema(schema: str) -> str | None:
    """Why a JSON schema cannot guide decoding (None: it can). Remembered for the last
    128 schemas: a named tool's parameters are checked by the chat front door and again
    as the request's schema, and clients send the same tools with every request."""
    from llguidance import LLMatcher

    try:
        text = grammar(schema)
    except ValueError as e:
        return str(e)
    error = LLMatcher.validate_grammar(text)
    return error or None
