"""Per-request sampling and stopping parameters.

`SamplingParams` is frozen and validated on construction: a bad value raises
:class:`~pdserve.core.errors.InvalidArgumentError` naming the field, so the same
checks guard the offline API, the command line and the network front doors.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from pdserve.core.errors import InvalidArgumentError

_GREEDY_EPS = 1e-5
# Bounds that keep every value representable wherever it travels (msgpack step
# plans carry 64-bit integers) and keep one request's stop matching cheap.
MAX_INT = 2**31 - 1
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024
MAX_PRIORITY = 1_000_000
MAX_LOGPROBS = 20  # alternatives per token a request may ask for
MAX_LOGIT_BIAS = 300  # tokens one request may bias (OpenAI's limit)
MAX_REPETITION_PENALTY = 10.0
MAX_SCHEMA_CHARS = 65536
MAX_CACHE_SALT_CHARS = 1024


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop.

    Attributes:
        max_tokens: most tokens to generate (>= 1).
        min_tokens: EOS and stop tokens are ignored until this many are generated.
        temperature: 0 means greedy; otherwise logits are divided by it.
        top_k: keep only the k most likely tokens (0 or -1: off).
        top_p: keep the smallest set of tokens whose probability reaches top_p (1: off).
        seed: makes sampling reproducible for this request, whatever it is batched with.
        stop: strings that end generation; by default they are cut from the text.
        stop_token_ids: token ids that end generation (kept in ``token_ids``).
        ignore_eos: keep generating past the model's EOS tokens.
        include_stop_str_in_output: keep the matched stop string in the text.
        skip_special_tokens: leave special tokens out of the decoded text.
        priority: how much the request matters (higher: more); under the priority
            eviction policy its KV blocks are kept longer than lower ones'.
        lora: name of the LoRA adapter to run the request under (None: the base model).
        logprobs: return each generated token's log-probability under the model
            (its raw distribution, before logit_bias, temperature and top-k/p) and the
            ``logprobs`` most likely tokens' (0 to 20); None: none.
        logit_bias: (token id, bias) pairs added to the logits before sampling, each
            bias in [-100, 100] (a dict is accepted; stored sorted by token id).
        presence_penalty: subtracted from the logit of every token generated so far
            (OpenAI's definition; -2 to 2, 0: off).
        frequency_penalty: subtracted from a token's logit once per time it was
            generated so far (-2 to 2, 0: off).
        repetition_penalty: divides the positive logits and multiplies the negative
            ones of every token in the prompt or generated so far (as transformers'
            ``repetition_penalty``; above 1 discourages repeats; 1: off).
        prompt_logprobs: return each prompt token's log-probability given the tokens
            before it (the first has none) and the ``prompt_logprobs`` likeliest tokens'
            (0 to 20); the prompt is then computed in full, without prefix-cache hits.
        json_schema: a JSON schema (as JSON text) the output must follow; decoding is
            constrained to it (``{"type": "object"}``: any JSON object). None: free text.
        cache_salt: the request's prefix-cache tenant: it reuses cached KV only of
            requests with the same salt (None: the shared tenant). The front doors set
            it from the caller's API key and the request's ``cache_salt`` field.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    lora: str | None = None
    logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    json_schema: str | None = None
    prompt_logprobs: int | None = None
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        # Accept lists and a lone string from callers; store tuples so the
        # object stays hashable and immutable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            object.__setattr__(self, "stop", tuple(self.stop))
        if not isinstance(self.stop_token_ids, tuple):
            object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        self._validate()

    def _validate(self) -> None:
        _check_int("max_tokens", self.max_tokens)
        if not 1 <= self.max_tokens <= MAX_INT:
            raise InvalidArgumentError(
                "max_tokens", f"must be in [1, {MAX_INT}], got {self.max_tokens}"
            )
        _check_int("min_tokens", self.min_tokens)
        if not 0 <= self.min_tokens <= self.max_tokens:
            raise InvalidArgumentError(
                "min_tokens",
                f"must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}",
            )
        _check_number("temperature", self.temperature)
        if self.temperature < 0:
            raise InvalidArgumentError("temperature", f"must be >= 0, got {self.temperature}")
        _check_int("top_k", self.top_k)
        if not -1 <= self.top_k <= MAX_INT:
            raise InvalidArgumentError(
                "top_k", f"must be -1, 0 (off) or in [1, {MAX_INT}], got {self.top_k}"
            )
        _check_number("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise InvalidArgumentError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.seed is not None:
            _check_int("seed", self.seed)
            if not 0 <= self.seed < 2**63:
                raise InvalidArgumentError("seed", f"must be in [0, 2**63), got {self.seed}")
        self._validate_stops()
        _check_int("priority", self.priority)
        if not -MAX_PRIORITY <= self.priority <= MAX_PRIORITY:
            raise InvalidArgumentError(
                "priority", f"must be in [-{MAX_PRIORITY}, {MAX_PRIORITY}], got {self.priority}"
            )
        if self.lora is not None and (
            not isinstance(self.lora, str) or not self.lora or len(self.lora) > 128
        ):
            raise InvalidArgumentError("lora", "must be an adapter name of 1 to 128 characters")
        for name in ("logprobs", "prompt_logprobs"):
            _check_logprobs(name, getattr(self, name))
        check_cache_salt("cache_salt", self.cache_salt)
        self._validate_penalties()
        if self.json_schema is not None:
            _check_schema(self.json_schema)
            if self.min_tokens:  # past the schema's value only EOS is allowed
                raise InvalidArgumentError("min_tokens", "cannot be combined with a json_schema")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgumentError(name, "must be a boolean")

    def _validate_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check_number(name, value)
            if not -2 <= value <= 2:
                raise InvalidArgumentError(name, f"must be in [-2, 2], got {value}")
        _check_number("repetition_penalty", self.repetition_penalty)
        if not 0 < self.repetition_penalty <= MAX_REPETITION_PENALTY:
            raise InvalidArgumentError(
                "repetition_penalty",
                f"must be in (0, {MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty}",
            )

    @property
    def penalties(self) -> tuple[float, float, float] | tuple[()]:
        """(presence, frequency, repetition) when any is on; () otherwise."""
        if self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1:
            return (self.presence_penalty, self.frequency_penalty, self.repetition_penalty)
        return ()

    def _validate_stops(self) -> None:
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidArgumentError("stop", f"at most {MAX_STOP_STRINGS} strings")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise InvalidArgumentError("stop", f"must be non-empty strings, got {s!r}")
            if len(s) > MAX_STOP_STRING_CHARS:
                raise InvalidArgumentError(
                    "stop", f"each string must be at most {MAX_STOP_STRING_CHARS} characters"
                )
            check_text("stop", s)
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidArgumentError("stop_token_ids", f"at most {MAX_STOP_TOKEN_IDS} ids")
        for t in self.stop_token_ids:
            _check_int("stop_token_ids", t)
            if not 0 <= t <= MAX_INT:
                raise InvalidArgumentError("stop_token_ids", f"must be in [0, {MAX_INT}], got {t}")

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids this request names must exist in a model of ``vocab_size`` tokens."""
        named = [("stop_token_ids", t) for t in self.stop_token_ids]
        for name, t in named + [("logit_bias", t) for t, _ in self.logit_bias]:
            if t >= vocab_size:
                raise InvalidArgumentError(
                    name, f"{t} is not a token of this model (vocabulary {vocab_size})"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SamplingParams:
        """Build from a plain mapping (a wire message), rejecting unknown names."""
        known = set(cls.__dataclass_fields__)
        for name in values:
            if name not in known:
                raise InvalidArgumentError(name, "unknown sampling parameter")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


def _bias_pairs(value: object) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as sorted (token id, bias) pairs, checked."""
    if isinstance(value, dict):
        items: Any = list(value.items())
    elif isinstance(value, tuple | list):
        items = value
    else:
        raise InvalidArgumentError("logit_bias", "must map token ids to biases")
    pairs = []
    for item in items:
        if not isinstance(item, tuple | list) or len(item) != 2:
            raise InvalidArgumentError("logit_bias", "must map token ids to biases")
        token, bias = item
        _check_int("logit_bias", token)
        _check_number("logit_bias", bias)
        if not 0 <= token <= MAX_INT:
            raise InvalidArgumentError(
                "logit_bias", f"token ids must be in [0, {MAX_INT}], got {token}"
            )
        if not -100 <= bias <= 100:
            raise InvalidArgumentError("logit_bias", f"biases must be in [-100, 100], got {bias}")
        pairs.append((token, float(bias)))
    if len(pairs) > MAX_LOGIT_BIAS:
        raise InvalidArgumentError("logit_bias", f"at most {MAX_LOGIT_BIAS} tokens")
    if len({token for token, _ in pairs}) < len(pairs):  # e.g. JSON keys "7" and "07"
        raise InvalidArgumentError("logit_bias", "names a token more than once")
    return tuple(sorted(pairs))


def _check_logprobs(name: str, value: object) -> None:
    if value is not None:
        _check_int(name, value)
        assert isinstance(value, int)
        if not 0 <= value <= MAX_LOGPROBS:
            raise InvalidArgumentError(name, f"must be in [0, {MAX_LOGPROBS}], got {value}")


def _check_schema(schema: object) -> None:
    if not isinstance(schema, str) or len(schema) > MAX_SCHEMA_CHARS:
        raise InvalidArgumentError(
            "json_schema", f"must be JSON text of at most {MAX_SCHEMA_CHARS} characters"
        )
    try:
        parsed = json.loads(schema)
    except ValueError as e:
        raise InvalidArgumentError("json_schema", f"is not JSON: {e}") from None
    if not isinstance(parsed, dict):
        raise InvalidArgumentError("json_schema", "must be a JSON object (a schema)")
    from pdserve.core.structured import check_schema

    error = check_schema(schema)
    if error is not None:
        raise InvalidArgumentError("json_schema", f"cannot guide decoding: {error[:300]}")


def _check_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgumentError(name, f"must be an integer, got {type(value).__name__}")


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgumentError(name, f"must be a number, got {type(value).__name__}")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int too large for a float
        finite = False
    if not finite:
        raise InvalidArgumentError(name, "must be a finite number")


def check_cache_salt(name: str, value: object) -> None:
    """None, or a string of 1 to ``MAX_CACHE_SALT_CHARS`` characters (valid Unicode)."""
    if value is None:
        return
    if not isinstance(value, str) or not value or len(value) > MAX_CACHE_SALT_CHARS:
        raise InvalidArgumentError(
            name, f"must be a string of 1 to {MAX_CACHE_SALT_CHARS} characters"
        )
    check_text(name, value)


def check_text(name: str, value: str) -> None:
    """A string that must cross process boundaries: encodable as UTF-8 (no lone surrogates)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidArgumentError(
            name, f"is not valid Unicode (character {e.start} cannot be encoded as UTF-8)"
        ) from None
