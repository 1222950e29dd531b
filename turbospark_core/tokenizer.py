"""The install's tokenizer: encode/decode, chat template, streaming detokenization."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as _HFTokenizer

from turbospark_core.errors import TokenizerError


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older configs
        return value.get("content")
    return value if isinstance(value, str) else None


def _raise_exception(message: str) -> None:
    raise TokenizerError(f"chat template refused the messages: {message}")


class Tokenizer:
    """Hugging Face ``tokenizer.json`` plus ``tokenizer_config.json`` (chat template, specials)."""

    def __init__(self, backend: _HFTokenizer, config: dict[str, Any], eos_ids: list[int]) -> None:
        self._tok = backend
        self.config = config
        self.chat_template: str | None = config.get("chat_template")
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        own_eos = self.token_to_id(self.eos_token) if self.eos_token else None
        self.eos_token_ids = sorted({*eos_ids, *([own_eos] if own_eos is not None else [])})

    @classmethod
    def from_install(
        cls,
        root: Path,
        generation_config: dict[str, Any],
        default_template: str | Callable[[], str | None] | None = None,
    ) -> Tokenizer:
        """Load from an install directory.

        Args:
            root: The install directory.
            generation_config: Its ``generation_config.json`` (extra EOS ids).
            default_template: The family's chat template, or a callable that
                asks for it; used (called) only when the install has none.

        Raises:
            TokenizerError: ``tokenizer.json`` is missing or unreadable.
        """
        try:
            backend = _HFTokenizer.from_file(str(root / "tokenizer.json"))
        except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception
            msg = f"{root / 'tokenizer.json'} could not be loaded ({e}); re-run `turbospark convert`"
            raise TokenizerError(msg) from None
        config_path = root / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        if not config.get("chat_template") and default_template is not None:
            config["chat_template"] = default_template() if callable(default_template) else default_template
        eos = generation_config.get("eos_token_id")
        eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
        return cls(backend, config, eos_ids)

    @property
    def vocab_size(self) -> int:
        """Tokens known, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        """The id of a token string, or ``None``."""
        return self._tok.token_to_id(token)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids for ``text`` (with BOS etc. when the tokenizer adds them)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        """Text for ``ids``."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], *, add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """Render ``messages`` with the install's chat template.

        Raises:
            TokenizerError: The install has no chat template, or it failed.
        """
        if not self.chat_template:
            msg = "this install has no chat template; use generate() with a plain prompt"
            raise TokenizerError(msg)
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise_exception
        try:
            return env.from_string(self.chat_template).render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
                **extra,
            )
        except jinja2.TemplateError as e:
            msg = f"the install's chat template failed to render: {e}"
            raise TokenizerError(msg) from None

    def detokenizer(self) -> StreamingDetokenizer:
        """A fresh streaming detokenizer."""
        return StreamingDetokenizer(self)


class StreamingDetokenizer:
    """Turns a token stream into text pieces, holding back incomplete UTF-8."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tok = tokenizer
        self.tokens: list[int] = []
        self._prefix = 0
        self._read = 0

    def add(self, token: int) -> str:
        """Add one token; returns the text it completes (may be empty)."""
        self.tokens.append(token)
        before = self._tok.decode(self.tokens[self._prefix : self._read])
        after = self._tok.decode(self.tokens[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self.tokens)
            return after[len(before) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back."""
        before = self._tok.decode(self.tokens[self._prefix : self._read])
        after = self._tok.decode(self.tokens[self._prefix :])
        self._prefix = self._read = len(self.tokens)
        return after[len(before) :]
