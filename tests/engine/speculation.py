"""The speculative decoding the engine tests turn on: prompt lookup (n-gram drafts from one
matching token), verified for up to 64 rows a step."""

from __future__ import annotations

SPEC = dict(speculative_method="ngram", prompt_lookup_min=1, speculative_max_batch=64)
