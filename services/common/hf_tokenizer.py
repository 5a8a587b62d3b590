"""``HfTokenizer``: the tokenizer protocol over a Hugging Face model directory.

It reads ``tokenizer.json`` with the ``tokenizers`` library and renders the model's own chat
template (``chat_template.jinja`` or ``tokenizer_config.json``) in a sandboxed jinja2 environment,
so that serving needs neither ``transformers`` nor any code from the model repository.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

from jinja2.exceptions import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _RustTokenizer

from services.common.tokenizer import ChatMessage, StreamDecoder

# The layout ``ByteTokenizer`` writes by hand, used for models that ship no template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class HfTokenizer:
    """The tokenizer of a Hugging Face model directory."""

    def __init__(self, model_dir: Path) -> None:
        self._tokenizer = _RustTokenizer.from_file(str(model_dir / "tokenizer.json"))
        config = _read_json(model_dir / "tokenizer_config.json")
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.eos_token_id = self._eos_token_id(model_dir)
        self.vocab_size = self._tokenizer.get_vocab_size(with_added_tokens=True)
        template_file = model_dir / "chat_template.jinja"
        # transformers lets the separate file win over the config entry; so do we.
        if template_file.is_file():
            source = template_file.read_text(encoding="utf-8")
        else:
            source = _default_template(config.get("chat_template")) or CHATML_TEMPLATE
        self.chat_template = source
        self._template = _jinja_environment().from_string(source)

    def _eos_token_id(self, model_dir: Path) -> int:
        if self.eos_token is not None:
            token_id = self._tokenizer.token_to_id(self.eos_token)
            if token_id is not None:
                return int(token_id)
        eos = _read_json(model_dir / "config.json").get("eos_token_id")
        # Some models list several end tokens; the first is the canonical one.
        if isinstance(eos, list) and eos:
            eos = eos[0]
        if isinstance(eos, int):
            return eos
        raise ValueError(f"{model_dir} names no end-of-sequence token")

    def encode(self, text: str) -> list[int]:
        # A chat template that starts with the BOS token already carries it; adding the
        # tokenizer's own special tokens as well would double it.
        add_special = not (self.bos_token and text.startswith(self.bos_token))
        return list(self._tokenizer.encode(text, add_special_tokens=add_special).ids)

    def decode(self, token_ids: Sequence[int]) -> str:
        return str(self._tokenizer.decode(list(token_ids), skip_special_tokens=True))

    def stream_decoder(self) -> StreamDecoder:
        return _WindowStreamDecoder(self)

    def apply_chat_template(self, messages: Sequence[ChatMessage]) -> str:
        return self._template.render(
            messages=[{"role": m.role, "content": m.content} for m in messages],
            add_generation_prompt=True,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        )


class _WindowStreamDecoder:
    """Decodes a window of already emitted tokens plus the new ones and emits only the text the
    new tokens add. The window gives tokenizers whose pieces depend on their neighbours (leading
    spaces, byte fallback) the context they need; text ending in U+FFFD is held back because the
    next token may complete the character."""

    def __init__(self, tokenizer: HfTokenizer) -> None:
        self._decode = tokenizer.decode
        # The last emitted chunk's tokens (the context window), then tokens not yet emitted.
        self._ids: list[int] = []
        self._emitted = 0

    def decode(self, token_ids: Sequence[int]) -> str:
        self._ids.extend(token_ids)
        context = self._decode(self._ids[: self._emitted])
        end = len(self._ids)
        text = self._decode(self._ids)
        # Only the last tokens begin a character: the text before them goes out now, as it would
        # have token by token. So what has gone out depends on the tokens alone, not on how they
        # were grouped into steps, and a migrated request's new worker, given the tokens its
        # client has, knows where the text its client has ends (``request_detokenizer``).
        while text.endswith("\ufffd") and end > self._emitted + 1:
            end -= 1
            text = self._decode(self._ids[:end])
        if len(text) <= len(context) or text.endswith("\ufffd"):
            return ""
        del self._ids[: self._emitted]
        self._emitted = end - self._emitted
        return text[len(context) :]

    def flush(self) -> str:
        context = self._decode(self._ids[: self._emitted])
        text = self._decode(self._ids)
        self._ids.clear()
        self._emitted = 0
        return text[len(context) :]


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else {}


def _token_text(token: object) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or a serialized AddedToken."""
    if isinstance(token, str):
        return token
    if isinstance(token, dict) and isinstance(token.get("content"), str):
        return str(token["content"])
    return None


def _default_template(entry: object) -> str | None:
    """The template of a ``chat_template`` entry, which may also be a list of named ones."""
    if isinstance(entry, str):
        return entry
    if isinstance(entry, list):
        for item in entry:
            if isinstance(item, dict) and item.get("name") == "default":
                template = item.get("template")
                return template if isinstance(template, str) else None
    return None


def _raise_exception(message: str) -> NoReturn:
    raise TemplateError(message)


def _tojson(
    value: object,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's own tojson escapes <, >, & and ' for HTML, which would corrupt prompts.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _jinja_environment() -> ImmutableSandboxedEnvironment:
    # The same settings and helpers transformers gives chat templates, so that templates written
    # for it render identically here.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
