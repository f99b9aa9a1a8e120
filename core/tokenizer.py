"""The tokenizer of a checkpoint folder, over Hugging Face ``tokenizers``.

Reads ``tokenizer.json`` and, when present, ``tokenizer_config.json`` (special
tokens, the chat template). Chat templates are rendered with Jinja2 in a
sandbox, as ``transformers`` does; a model without one gets a documented
plain-text fallback (see :data:`FALLBACK_CHAT_TEMPLATE`).
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from pdserve.core.errors import InvalidArgumentError, ModelNotFoundError

# Used when tokenizer_config.json has no chat_template: one "role: content" line
# per message, then "assistant:" to cue the reply.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}"
)


class Tokenizer:
    """Text <-> token ids for one model."""

    def __init__(self, hf: HFTokenizer, config: dict[str, Any] | None = None) -> None:
        self.hf = hf
        self.config = config or {}

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        folder = Path(path)
        file = folder / "tokenizer.json"
        if not file.is_file():
            raise ModelNotFoundError("tokenizer", f"no tokenizer.json in {str(folder)!r}")
        config: dict[str, Any] = {}
        config_file = folder / "tokenizer_config.json"
        if config_file.is_file():
            config = json.loads(config_file.read_text())
        return cls(HFTokenizer.from_file(str(file)), config)

    @property
    def vocab_size(self) -> int:
        return int(self.hf.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise InvalidArgumentError("prompt", f"must be a string, got {type(text).__name__}")
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def token_id(self, token: str) -> int | None:
        tid = self.hf.token_to_id(token)
        return None if tid is None else int(tid)

    @cached_property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.config.get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if not isinstance(eos, str):
            return ()
        tid = self.token_id(eos)
        return () if tid is None else (tid,)

    @property
    def chat_template(self) -> str:
        template = self.config.get("chat_template")
        return template if isinstance(template, str) and template else FALLBACK_CHAT_TEMPLATE

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """Render chat messages (and the tools the model may call, the template's ``tools``,
        as transformers passes them) to the prompt text the model was trained on."""
        from jinja2 import TemplateError

        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise InvalidArgumentError(
                    f"messages[{i}]", "each message needs 'role' and 'content'"
                )
        special = {
            k: (v.get("content") if isinstance(v, dict) else v)
            for k, v in self.config.items()
            if k in ("bos_token", "eos_token", "pad_token", "unk_token")
        }
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                **special,
            )
        except TemplateError as e:  # the template's raise_exception, or what it cannot render
            raise InvalidArgumentError("messages", f"the chat template refused them: {e}") from None

    @cached_property
    def _template(self) -> Any:
        """The chat template, compiled once, in a sandbox with the helpers that templates
        written for transformers call (``raise_exception``, ``strftime_now``, a ``tojson``
        that does not escape HTML) and its loop controls."""
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.filters["tojson"] = _tojson
        env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
        return env.from_string(self.chat_template)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    from jinja2 import TemplateError

    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)
