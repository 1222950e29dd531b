"""The install's tokenizer: encode/decode, chat template, streaming detokenization."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeGuard

from tokenizers import Tokenizer as _HFTokenizer

from turbospark_core.errors import TokenizerError
from turbospark_core.memory import release_freed_heap
from turbospark_core.template import render_template

MAX_CONFIG_BYTES = 16 * 1024 * 1024


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older configs
        value = value.get("content")
    if not isinstance(value, str):
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate ("\ud800" in the JSON) is no token
        return None
    return value


@contextlib.contextmanager
def _backend(what: str) -> Iterator[None]:
    """What the tokenizers library raises (a Rust panic is a BaseException) as a TokenizerError."""
    try:
        yield
    except (KeyboardInterrupt, SystemExit, GeneratorExit, TokenizerError):
        raise
    except BaseException as e:  # noqa: BLE001 - tokenizers raises plain Exception, or pyo3's PanicException
        msg = (
            f"the install's tokenizer failed to {what} ({type(e).__name__}: {str(e)[:200]}); "
            "re-run `turbospark convert`"
        )
        raise TokenizerError(msg) from None


def _is_id(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 31


def _read_config(path: Path) -> dict[str, Any]:
    """``tokenizer_config.json`` (bounded, typed): an object whose ``chat_template`` is a string or absent."""
    if not path.is_file():
        return {}
    if path.stat().st_size > MAX_CONFIG_BYTES:
        msg = f"{path} is over the {MAX_CONFIG_BYTES}-byte bound for a tokenizer config; re-run `turbospark convert`"
        raise TokenizerError(msg)
    try:
        config = json.loads(path.read_bytes())
    except (ValueError, RecursionError) as e:  # bad JSON or UTF-8, huge integers, nesting bombs
        msg = f"{path} is not valid JSON ({str(e)[:200]}); re-run `turbospark convert`"
        raise TokenizerError(msg) from None
    if not isinstance(config, dict):
        msg = f"{path} must hold a JSON object, got {type(config).__name__}; re-run `turbospark convert`"
        raise TokenizerError(msg)
    template = config.get("chat_template")
    if isinstance(template, list):  # Hugging Face's named form: [{"name": ..., "template": ...}]
        named = {
            t["name"]: t.get("template") for t in template if isinstance(t, dict) and isinstance(t.get("name"), str)
        }
        template = config["chat_template"] = named.get("default")
    if template is not None and not isinstance(template, str):
        msg = (
            f"{path}: 'chat_template' must be a string (or named templates with a 'default'), "
            f"got {type(template).__name__}; re-run `turbospark convert`"
        )
        raise TokenizerError(msg)
    return config


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
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # noqa: BLE001 - tokenizers raises plain Exception, or a Rust panic (BaseException)
            msg = f"{root / 'tokenizer.json'} could not be loaded ({e}); re-run `turbospark convert`"
            raise TokenizerError(msg) from None
        finally:
            release_freed_heap()  # the parse frees about twice what the tokenizer keeps (Gemma 3: 200 of 300 MB)
        config = _read_config(root / "tokenizer_config.json")
        if not config.get("chat_template") and default_template is not None:
            config["chat_template"] = default_template() if callable(default_template) else default_template
        eos = generation_config.get("eos_token_id")
        eos_ids = [eos] if _is_id(eos) else [i for i in eos if _is_id(i)] if isinstance(eos, list) else []
        return cls(backend, config, eos_ids)

    @property
    def vocab_size(self) -> int:
        """Tokens known, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        """The id of a token string, or ``None``."""
        with _backend("look up a token"):
            return self._tok.token_to_id(token)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids for ``text`` (with BOS etc. when the tokenizer adds them).

        Raises:
            TokenizerError: The install's tokenizer fails on ``text`` (a malformed
                ``tokenizer.json`` can make the tokenizers library panic).
        """
        with _backend("encode text"):
            return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        """Text for ``ids``."""
        with _backend("decode tokens"):
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
        variables = {
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            **extra,
        }
        return render_template(self.chat_template, variables)

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
