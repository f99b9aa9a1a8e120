"""Turn a front door's request fields into a validated :class:`CompletionInput`.

Both front doors (gRPC, HTTP) hand plain values here, so a malformed request
gets the same error, naming the same field, whichever door it came through.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from pdserve.core.errors import InvalidArgumentError
from pdserve.core.sampling_params import SamplingParams, check_cache_salt, check_text
from pdserve.core.tokenizer import Tokenizer
from pdserve.router.frontdoor.auth import cache_salt
from pdserve.router.models import ServedVersion
from pdserve.router.placement import CompletionInput

if TYPE_CHECKING:
    from pdserve.router.router import Router

MAX_ID_CHARS = 128  # request ids and region names a client sends
# Requests larger than this are tokenized on a worker thread, so a multi-megabyte
# prompt does not stall the event loop that streams every other request's tokens.
OFF_LOOP_BYTES = 64 << 10

T = TypeVar("T")


async def off_loop(size: int, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` here if the request is small, else on a worker thread."""
    if size <= OFF_LOOP_BYTES:
        return fn(*args)
    return await asyncio.to_thread(fn, *args)


# Names the front doors accept for sampling, mapped to SamplingParams fields.
SAMPLING_FIELDS = {
    "max_tokens": "max_tokens",
    "min_tokens": "min_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "seed": "seed",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "priority": "priority",
    "logprobs": "logprobs",
    "logit_bias": "logit_bias",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "repetition_penalty": "repetition_penalty",
    "json_schema": "json_schema",
}


def sampling_params(values: dict[str, Any], vocab_size: int | None = None) -> SamplingParams:
    """SamplingParams from front-door fields (None means: the default).

    With ``vocab_size``, token ids the request names are checked against the model.
    """
    given = {
        SAMPLING_FIELDS[k]: v for k, v in values.items() if k in SAMPLING_FIELDS and v is not None
    }
    if "stop" in given:
        stop = given["stop"]
        if isinstance(stop, str):
            given["stop"] = (stop,)
        elif not isinstance(stop, list | tuple) or not all(isinstance(s, str) for s in stop):
            raise InvalidArgumentError("stop", "must be a string or a list of strings")
    if "stop_token_ids" in given and not isinstance(given["stop_token_ids"], list | tuple):
        raise InvalidArgumentError("stop_token_ids", "must be a list of integers")
    if "ignore_eos" in given and not isinstance(given["ignore_eos"], bool):
        raise InvalidArgumentError("ignore_eos", "must be a boolean")
    if "logit_bias" in given:
        given["logit_bias"] = _bias_by_id(given["logit_bias"])
    params = SamplingParams(**given)
    if vocab_size is not None:
        params.check_vocab(vocab_size)
    return params


def _bias_by_id(value: Any) -> list[tuple[int, Any]]:
    """OpenAI's ``logit_bias`` (JSON keys are strings: ``{"50256": -100}``) as id pairs."""
    if not isinstance(value, dict):
        raise InvalidArgumentError("logit_bias", "must be an object of token id -> bias")
    pairs = []
    for key, bias in value.items():
        if isinstance(key, str) and key.isascii() and key.isdigit():
            pairs.append((int(key), bias))
        elif isinstance(key, int) and not isinstance(key, bool):
            pairs.append((key, bias))
        else:
            raise InvalidArgumentError(
                "logit_bias", f"keys must be token ids, got {str(key)[:32]!r}"
            )
    return pairs


def with_priority(params: SamplingParams, value: str) -> SamplingParams:
    """``params`` with the priority a header or metadata entry names (an integer)."""
    try:
        priority = int(value)
    except ValueError:
        raise InvalidArgumentError("priority", f"must be an integer, got {value!r}") from None
    return dataclasses.replace(params, priority=priority)


def capped_priority(params: SamplingParams, key_priority: int | None) -> SamplingParams:
    """A key's priority is its requests' default and their ceiling: a request may
    yield below it, and one asking for more gets the key's (a batch key at -1 must
    not preempt online traffic by asking; a batch runner's own -1 still runs under
    a key at -2)."""
    if key_priority is None or params.priority <= key_priority:
        return params
    return dataclasses.replace(params, priority=key_priority)


def with_cache_salt(params: SamplingParams, tenant: str | None, asked: Any) -> SamplingParams:
    """``params`` in the prefix-cache tenant of the caller's key (None: auth is off),
    salted again by the ``cache_salt`` the request names (as vLLM's; None: none)."""
    check_cache_salt("cache_salt", asked)
    return dataclasses.replace(params, cache_salt=cache_salt(tenant, asked))


def prompt_tokens(
    tokenizer: Tokenizer | None,
    prompt: str | list[int] | None,
    max_model_len: int,
    vocab_size: int,
    field: str = "prompt",
    add_special_tokens: bool = True,
) -> list[int]:
    if prompt is None:
        raise InvalidArgumentError(field, "is required")
    if isinstance(prompt, str):
        if not prompt:
            raise InvalidArgumentError(field, "must not be empty")
        check_text(field, prompt)
        if tokenizer is None:
            raise InvalidArgumentError(field, "the model has no tokenizer: send token ids")
        ids = tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
    elif isinstance(prompt, list) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    ):
        ids = list(prompt)
        if any(not 0 <= t < vocab_size for t in ids):
            raise InvalidArgumentError(field, f"token ids must be in [0, {vocab_size})")
    else:
        raise InvalidArgumentError(field, "must be a string or a list of token ids")
    if not ids:
        raise InvalidArgumentError(field, "must not be empty")
    check_prompt_len(field, len(ids), max_model_len)
    return ids


def check_prompt_len(field: str, num_tokens: int, max_model_len: int) -> None:
    """Refuse a prompt that leaves no room for a token within the context limit."""
    if max_model_len and num_tokens >= max_model_len:
        raise InvalidArgumentError(
            field,
            f"{num_tokens} tokens leave no room to generate within the context limit of {max_model_len}",
        )


def fit_context(
    params: SamplingParams, prompt_len: int, max_model_len: int, asked: bool
) -> SamplingParams:
    """Refuse a ``max_tokens`` the context cannot hold; shrink the default one to fit.

    ``asked``: the client set ``max_tokens`` itself (then it is never cut silently).
    """
    room = max_model_len - prompt_len
    if not max_model_len or params.max_tokens <= room:
        return params
    if asked:
        raise InvalidArgumentError(
            "max_tokens",
            f"{prompt_len} prompt tokens + {params.max_tokens} new tokens exceed the context "
            f"limit of {max_model_len}; ask for at most {room}",
        )
    return dataclasses.replace(params, max_tokens=room, min_tokens=min(params.min_tokens, room))


def completion_input(
    prompt_ids: list[int],
    params: SamplingParams,
    region: Any,
    request_id: Any,
    version: ServedVersion | None = None,
) -> CompletionInput:
    """The router's input; ``request_id`` is the client's, only echoed back; ``version``
    the model version serving it (None: the cluster's own model)."""
    if request_id is not None:
        request_id = _name("request_id", request_id, MAX_ID_CHARS)
    rid = request_id or f"req-{uuid.uuid4().hex}"
    if region is not None:
        region = _name("region", region, MAX_ID_CHARS)
    if version is None:
        return CompletionInput(rid, prompt_ids, params, region or None)
    return CompletionInput(rid, prompt_ids, params, region or None, version.key, version.label)


def _name(field: str, value: Any, limit: int) -> str:
    """An id or name a client chose: printable, short, valid Unicode (it reaches logs)."""
    if not isinstance(value, str):
        raise InvalidArgumentError(field, "must be a string")
    if len(value) > limit:
        raise InvalidArgumentError(field, f"must be at most {limit} characters")
    check_text(field, value)
    if not value.isprintable():
        raise InvalidArgumentError(field, "must not contain control or non-printable characters")
    return value


def openai_models(router: Router) -> list[dict[str, Any]]:
    """Every served model (its versions and their traffic shares), then its adapters."""
    out = []
    for model in router.catalog.models.values():
        versions = [
            {"version": v.version, "traffic": round(model.traffic.get(v.version, 0.0), 4)}
            for v in model.versions.values()
        ]
        stable = model.versions[model.stable]
        max_len = router.max_model_len_of(stable.key)
        out.append(
            {
                "id": model.name,
                "object": "model",
                "created": 0,
                "owned_by": "pdserve",
                "max_model_len": max_len,
                "parent": None,
                "versions": versions,
            }
        )
        adapters = dict.fromkeys(a for v in model.versions.values() for a in v.adapters)
        out += [
            {
                "id": a,
                "object": "model",
                "created": 0,
                "owned_by": "pdserve",
                "max_model_len": max_len,
                "parent": model.name,
            }
            for a in adapters
        ]
    return out
