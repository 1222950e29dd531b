"""The install's tokenizer: round-trips, chat template vs transformers, streaming detokenization."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from turbospark_core.errors import TokenizerError
from turbospark_core.tokenizer import Tokenizer

GENERATION_CONFIG = {"eos_token_id": [2, 4]}
TEXTS = [
    "hello world",
    "Once upon a time, in a land far away.",
    "héllo wörld: naïve café",
    "€100 — 😀👍🏽 日本語のテキスト 한국어",
    "  leading spaces\n\ttabs and\r\nnewlines  ",
    "",
]
CONVERSATIONS = [
    [{"role": "user", "content": "hi there"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Bonjour 😀"},
        {"role": "assistant", "content": "Salut !"},
        {"role": "user", "content": "Ça va ?\nLigne deux."},
    ],
]


@pytest.fixture(scope="module")
def tok_dir(llama_src: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The llama fixture's tokenizer files alone, as an install holds them."""
    root = tmp_path_factory.mktemp("tokenizer")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(llama_src / name, root / name)
    return root


@pytest.fixture(scope="module")
def tok(tok_dir: Path) -> Tokenizer:
    return Tokenizer.from_install(tok_dir, GENERATION_CONFIG)


def _with_config(tmp_path: Path, tok_dir: Path, **config: Any) -> Tokenizer:
    shutil.copy(tok_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    base = json.loads((tok_dir / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**base, **config}))
    return Tokenizer.from_install(tmp_path, {})


# ------------------------------------------------------------------ encode / decode


def test_specials_and_eos_ids(tok: Tokenizer) -> None:
    assert tok.bos_token == "<|bos|>" and tok.eos_token == "<|eos|>"
    assert tok.eos_token_ids == [2, 4]  # generation_config's list and the config's eos token
    assert tok.token_to_id("<|im_start|>") == 3 and tok.token_to_id("no such token") is None
    assert tok.vocab_size == 512
    assert tok.encode("hi")[0] == 1  # BOS added by the post-processor
    assert tok.encode("hi", add_special_tokens=False)[0] != 1


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_round_trip(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def test_decode_keeps_specials_when_asked(tok: Tokenizer) -> None:
    ids = tok.encode("hi")
    assert tok.decode(ids, skip_special_tokens=False).startswith("<|bos|>")


@settings(max_examples=60, deadline=None)
@given(st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=40))
def test_round_trip_any_text(tok: Tokenizer, text: str) -> None:
    assert tok.decode(tok.encode(text)) == text


# ------------------------------------------------------------------ chat template


@pytest.fixture(scope="module")
def hf_tokenizer(llama_src: Path) -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(llama_src))


@pytest.mark.parametrize("messages", CONVERSATIONS, ids=["user", "system-user", "multi-turn"])
def test_chat_template_renders_like_transformers(
    tok: Tokenizer, hf_tokenizer: Any, messages: list[dict[str, str]]
) -> None:
    ours = tok.apply_chat_template(messages, add_generation_prompt=True)
    theirs = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours == theirs
    assert ours.endswith("<|im_start|>assistant\n")
    no_prompt = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert no_prompt == hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)


def test_no_chat_template_is_refused(tmp_path: Path, tok_dir: Path) -> None:
    tok = _with_config(tmp_path, tok_dir, chat_template=None)
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_family_default_template_fills_in_only_when_the_install_has_none(tmp_path: Path, tok_dir: Path) -> None:
    default = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    own = Tokenizer.from_install(tok_dir, {}, default_template=default)
    assert own.apply_chat_template(CONVERSATIONS[0]).startswith("<|bos|><|im_start|>user")
    _with_config(tmp_path, tok_dir, chat_template=None)
    borrowed = Tokenizer.from_install(tmp_path, {}, default_template=default)
    assert borrowed.apply_chat_template(CONVERSATIONS[0]) == "[user] hi there\n"


def test_template_raise_exception_is_a_tokenizer_error(tmp_path: Path, tok_dir: Path) -> None:
    template = (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('Conversations must start with a user turn') }}"
        "{% endif %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    tok = _with_config(tmp_path, tok_dir, chat_template=template)
    assert tok.apply_chat_template([{"role": "user", "content": "ok"}]) == "ok"
    with pytest.raises(TokenizerError, match="Conversations must start with a user turn"):
        tok.apply_chat_template([{"role": "assistant", "content": "no"}])


@pytest.mark.parametrize(
    "template",
    [
        "{% for m in messages %}{{ m['content'] }}",  # unclosed block: syntax error
        "{{ messages[3]['content'] }}",  # indexes past the messages given
    ],
    ids=["syntax-error", "missing-message"],
)
def test_broken_template_is_a_tokenizer_error(tmp_path: Path, tok_dir: Path, template: str) -> None:
    tok = _with_config(tmp_path, tok_dir, chat_template=template)
    with pytest.raises(TokenizerError, match="chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_template_cannot_reach_python_internals(tmp_path: Path, tok_dir: Path) -> None:
    # templates come with downloaded models: they render in jinja2's sandbox
    tok = _with_config(tmp_path, tok_dir, chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(TokenizerError):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


# ------------------------------------------------------------------ loading


def test_missing_tokenizer_json_is_refused(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"tokenizer\.json") as err:
        Tokenizer.from_install(tmp_path, {})
    assert "turbospark convert" in str(err.value)


def test_corrupt_tokenizer_json_is_refused(tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match=r"tokenizer\.json"):
        Tokenizer.from_install(tmp_path, {})


def test_missing_tokenizer_config_means_no_template(tmp_path: Path, tok_dir: Path) -> None:
    shutil.copy(tok_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    tok = Tokenizer.from_install(tmp_path, {"eos_token_id": 2})
    assert tok.eos_token_ids == [2] and tok.chat_template is None
    assert tok.decode(tok.encode("still works")) == "still works"


# ------------------------------------------------------------------ streaming detokenization


def _stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    detok = tok.detokenizer()
    pieces = [detok.add(t) for t in ids]
    pieces.append(detok.flush())
    return pieces


@pytest.mark.parametrize("text", TEXTS)
def test_stream_of_valid_text_never_splits_a_character(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text, add_special_tokens=False)
    pieces = _stream(tok, ids)
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)


def test_multibyte_characters_are_held_until_complete(tok: Tokenizer) -> None:
    # byte-level BPE splits the emoji over several tokens: no piece may show half of it
    ids = tok.encode("😀", add_special_tokens=False)
    assert len(ids) > 1
    pieces = _stream(tok, ids)
    assert [p for p in pieces if p] == ["😀"]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 511), min_size=1, max_size=24))
def test_stream_concatenation_equals_decode_of_random_ids(tok: Tokenizer, ids: list[int]) -> None:
    assert "".join(_stream(tok, ids)) == tok.decode(ids)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(["a", "é", "€", "😀", "日", " ", "\n", "ab", "Ω"]), max_size=12))
def test_stream_of_multibyte_text_equals_decode(tok: Tokenizer, parts: list[str]) -> None:
    ids = tok.encode("".join(parts), add_special_tokens=False)
    pieces = _stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == "".join(parts)
    assert not any("\ufffd" in p for p in pieces)


def test_detokenizer_is_fresh_each_time(tok: Tokenizer) -> None:
    first = tok.detokenizer()
    first.add(tok.encode("x", add_special_tokens=False)[0])
    assert tok.detokenizer().tokens == []
