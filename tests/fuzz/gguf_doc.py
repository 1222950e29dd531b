"""A GGUF header as an editable structure (typed metadata, tensor infos), its writer and its mutations.

The seed is the SmolLM2 GGUF's real header with the vocabulary cut to its
first tokens (and the merges among them), so one input is a few kilobytes and
the tokenizer rebuild takes milliseconds; the tensor data is a sparse tail.
"""

from __future__ import annotations

import copy
import random
import struct
from pathlib import Path
from typing import Any

import attrs

from .mutate import hostile_value, mutate_bytes

STRING, ARRAY = 8, 9
SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
INT_RANGES = {0: (0, 2**8 - 1), 1: (-(2**7), 2**7 - 1), 2: (0, 2**16 - 1), 3: (-(2**15), 2**15 - 1), 4: (0, 2**32 - 1),
              5: (-(2**31), 2**31 - 1), 10: (0, 2**64 - 1), 11: (-(2**63), 2**63 - 1)}  # fmt: skip
EXTRA_KEYS = [
    "general.alignment", "llama.rope.scaling.type", "llama.rope.scaling.factor", "tokenizer.ggml.scores",
    "tokenizer.chat_template.tool_use", "tokenizer.ggml.add_eos_token", "llama.attention.key_length",
    "tokenizer.ggml.pre", "llama.expert_count", "llama.rope.scaling.original_context_length", "general.architecture",
]  # fmt: skip


@attrs.define
class KV:
    key: str
    types: list[int]  # [scalar], [STRING], [ARRAY, element...] (nested arrays: [ARRAY, ARRAY, ...])
    value: Any


@attrs.define
class TensorInfo:
    name: str
    dims: list[int]
    ggml_type: int
    offset: int


@attrs.define
class GGUFDoc:
    version: int
    kvs: list[KV]
    tensors: list[TensorInfo]
    data_size: int


def _encode(types: list[int], value: Any) -> bytes:
    """``value`` as GGUF type ``types`` (coerced when an edit left it of another type)."""
    kind = types[0]
    if kind == STRING:
        raw = (value if isinstance(value, str) else str(value)).encode("utf-8", "surrogatepass")
        return struct.pack("<Q", len(raw)) + raw
    if kind == ARRAY:
        items = list(value) if isinstance(value, list) else []
        return struct.pack("<IQ", types[1], len(items)) + b"".join(_encode(types[1:], v) for v in items)
    if kind in INT_RANGES:
        lo, hi = INT_RANGES[kind]
        number = value if isinstance(value, int) else 0
        return struct.pack(SCALAR[kind], min(max(number, lo), hi))
    if kind == 7:
        return struct.pack("<?", bool(value) if not isinstance(value, (list, dict)) else False)
    number = value if isinstance(value, (int, float)) else 0.0
    try:
        return struct.pack(SCALAR[kind], number)
    except (OverflowError, struct.error):
        return struct.pack(SCALAR[kind], float("inf"))


def serialize(doc: GGUFDoc, alignment: int = 32) -> tuple[bytes, int]:
    """The header bytes and the file size (header aligned + data section)."""
    out = [b"GGUF", struct.pack("<IQQ", doc.version, len(doc.tensors), len(doc.kvs))]
    for kv in doc.kvs:
        out.append(_encode([STRING], kv.key) + struct.pack("<I", kv.types[0]) + _encode(kv.types, kv.value))
    for t in doc.tensors:
        out.append(_encode([STRING], t.name) + struct.pack("<I", len(t.dims)))
        out.append(b"".join(struct.pack("<Q", d) for d in t.dims) + struct.pack("<IQ", t.ggml_type, t.offset))
    header = b"".join(out)
    start = -(-len(header) // alignment) * alignment
    return header, start + doc.data_size


def write(path: Path, header: bytes, size: int) -> None:
    """The header, then a sparse data section up to ``size`` bytes (capped)."""
    with path.open("wb") as f:
        f.write(header)
        f.truncate(max(len(header), min(size, 1 << 31)))


def seed_from(path: Path, keep_tokens: int = 400, keep_layers: int = 2) -> GGUFDoc:
    """The header of a real GGUF file with its vocabulary cut to ``keep_tokens`` tokens and its
    tensor infos to the global tensors and those of the first ``keep_layers`` blocks."""
    from gguf import GGUFReader

    from turbospark_core.convert.gguf_reader import open_gguf

    src = open_gguf(path)
    fields = GGUFReader(str(path)).fields
    kvs = [KV(key=k, types=[int(t) for t in fields[k].types], value=v) for k, v in src.metadata.items()]
    infos = [i for i in src._infos.values() if not i.name.startswith("blk.") or int(i.name.split(".")[1]) < keep_layers]
    first = min(i.offset for i in infos)
    tensors = [
        TensorInfo(name=i.name, dims=list(i.dims), ggml_type=i.ggml_type, offset=i.offset - first) for i in infos
    ]
    end = max(i.offset + (i.n_bytes or 0) for i in infos) - first
    doc = GGUFDoc(version=3, kvs=kvs, tensors=tensors, data_size=end)
    _cut_vocab(doc, keep_tokens)
    for kv in doc.kvs:
        if kv.key.endswith(".block_count"):
            kv.value = keep_layers
    return doc


def _cut_vocab(doc: GGUFDoc, n: int) -> None:
    by_key = {kv.key: kv for kv in doc.kvs}
    tokens = by_key["tokenizer.ggml.tokens"].value[:n]
    by_key["tokenizer.ggml.tokens"].value = tokens
    for key in ("tokenizer.ggml.token_type", "tokenizer.ggml.scores"):
        if key in by_key:
            by_key[key].value = by_key[key].value[:n]
    known = set(tokens)
    if "tokenizer.ggml.merges" in by_key:
        merges = [m for m in by_key["tokenizer.ggml.merges"].value if _merge_known(m, known)]
        by_key["tokenizer.ggml.merges"].value = merges
    for kv in doc.kvs:
        if kv.key.endswith(".vocab_size"):
            kv.value = n
        if kv.key.endswith("_token_id") and kv.value >= n:
            kv.value = 0


def _merge_known(merge: str, known: set[str]) -> bool:
    left, _, right = merge.partition(" ")
    return left in known and right in known and left + right in known


# ------------------------------------------------------------------ mutations
def _value_for(rnd: random.Random, types: list[int], near: Any = None) -> Any:
    kind = types[0]
    if kind in INT_RANGES:
        lo, hi = INT_RANGES[kind]
        return rnd.choice([lo, hi, 0, 1, 2, 3, 31, 32, 33, 4096, rnd.randint(lo, hi)])
    if kind in (6, 12):
        return rnd.choice([0.0, -1.0, 1e-30, 1e30, float("inf"), float("nan"), 3.4e38 if kind == 6 else 1e308, 0.5])
    if kind == 7:
        return rnd.random() < 0.5
    if kind == STRING:
        value = hostile_value(rnd, near if isinstance(near, str) else "x")
        return value if isinstance(value, str) else str(value)[:64]
    count = rnd.choice([0, 1, 2, 5]) if not isinstance(near, list) else len(near)
    return [
        _value_for(rnd, types[1:], near[i] if isinstance(near, list) and i < len(near) else None)
        for i in range(min(count, 64))
    ]


def _random_types(rnd: random.Random) -> list[int]:
    roll = rnd.random()
    if roll < 0.6:
        return [rnd.choice([*SCALAR, STRING])]
    if roll < 0.9:
        return [ARRAY, rnd.choice([*SCALAR, STRING])]
    return [ARRAY, ARRAY, rnd.choice([4, STRING, ARRAY])] if roll < 0.97 else [ARRAY, ARRAY, ARRAY, 4]


def _fill(types: list[int]) -> list[int]:
    return types if types[-1] != ARRAY else [*types, 4]


def mutate_doc(rnd: random.Random, seed: GGUFDoc) -> GGUFDoc:
    """One to three structural edits of the header."""
    doc = copy.deepcopy(seed)
    for _ in range(rnd.choice([1, 1, 2, 3])):
        rnd.choice(_EDITS)(rnd, doc)
    return doc


def _edit_value(rnd: random.Random, doc: GGUFDoc) -> None:
    kv = rnd.choice(doc.kvs)
    if kv.types[0] == ARRAY and isinstance(kv.value, list) and kv.value and rnd.random() < 0.6:
        _edit_array(rnd, kv)
        return
    kv.value = _value_for(rnd, kv.types, kv.value)


def _edit_array(rnd: random.Random, kv: KV) -> None:
    items = list(kv.value)
    i = rnd.randrange(len(items))
    roll = rnd.random()
    if roll < 0.3:
        items[i] = _value_for(rnd, kv.types[1:], items[i])
    elif roll < 0.45:
        del items[i:]
    elif roll < 0.6:
        items.insert(i, items[rnd.randrange(len(items))])
    elif roll < 0.75 and isinstance(items[i], str):  # a merge or token naming something unknown
        items[i] = rnd.choice(["zz qq", "a", "", " ", "a b c", items[i] + "\u0100", "<0xZZ>"])
    else:
        j = rnd.randrange(len(items))
        items[i], items[j] = items[j], items[i]
    kv.value = items


def _edit_type(rnd: random.Random, doc: GGUFDoc) -> None:
    kv = rnd.choice(doc.kvs)
    kv.types = _fill(_random_types(rnd))
    kv.value = _value_for(rnd, kv.types, kv.value)


def _edit_keys(rnd: random.Random, doc: GGUFDoc) -> None:
    roll = rnd.random()
    if roll < 0.4 and doc.kvs:
        del doc.kvs[rnd.randrange(len(doc.kvs))]
    elif roll < 0.55 and doc.kvs:
        doc.kvs.append(copy.deepcopy(rnd.choice(doc.kvs)))  # a repeated key
    else:
        types = _fill(_random_types(rnd))
        doc.kvs.append(KV(key=rnd.choice(EXTRA_KEYS), types=types, value=_value_for(rnd, types)))


def _edit_tensor(rnd: random.Random, doc: GGUFDoc) -> None:
    if not doc.tensors:
        return
    t = rnd.choice(doc.tensors)
    roll = rnd.random()
    if roll < 0.3:
        i = rnd.randrange(len(t.dims))
        t.dims[i] = rnd.choice([0, 1, 31, 33, t.dims[i] * 2, 2**32, 2**63, 2**64 - 1])
    elif roll < 0.45:
        t.dims = rnd.choice([[], [1] * 5, [*t.dims, 1], t.dims[:1]])
    elif roll < 0.65:
        t.ggml_type = rnd.choice([0, 1, 2, 3, 6, 8, 10, 12, 14, 15, 30, 39, 99, 2**32 - 1])
    elif roll < 0.8:
        t.offset = rnd.choice([1, 31, 2**40, 2**64 - 1, t.offset + 32, doc.data_size])
    elif roll < 0.9:
        doc.tensors.append(copy.deepcopy(t))  # a repeated name
    else:
        doc.tensors.remove(t)


def _edit_counts(rnd: random.Random, doc: GGUFDoc) -> None:
    doc.version = rnd.choice([0, 1, 2, 3, 4, 2**32 - 1])


def _edit_tokenizer(rnd: random.Random, doc: GGUFDoc) -> None:
    """The edits behind issue 20's BPE escape: merges, ids and types that disagree with the tokens."""
    by_key = {kv.key: kv for kv in doc.kvs}
    key = rnd.choice(["tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.tokens",
                      "tokenizer.ggml.bos_token_id", "tokenizer.ggml.model", "tokenizer.ggml.pre"])  # fmt: skip
    kv = by_key.get(key)
    if kv is None:
        return
    if key in ("tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.tokens") and not isinstance(
        kv.value, list
    ):
        return  # an earlier edit changed its type
    if key == "tokenizer.ggml.merges" and kv.value:
        kv.value = [*kv.value, rnd.choice(["nope nope", "Ġ zzz", str(kv.value[0]).replace(" ", "")])]
    elif key == "tokenizer.ggml.token_type" and kv.value:
        kv.value = [rnd.choice([0, 1, 2, 3, 4, 5, 6, -1, 2**31 - 1]) if rnd.random() < 0.05 else v for v in kv.value]
    elif key == "tokenizer.ggml.tokens" and kv.value:
        i = rnd.randrange(len(kv.value))
        kv.value = [*kv.value[:i], kv.value[rnd.randrange(len(kv.value))], *kv.value[i + 1 :]]
    elif key.endswith("_id"):
        tokens = by_key["tokenizer.ggml.tokens"].value if "tokenizer.ggml.tokens" in by_key else []
        kv.value = rnd.choice([0, 2**32 - 1, len(tokens) if isinstance(tokens, list) else 1])
    else:
        kv.value = rnd.choice(["gpt2", "llama", "bert", "smollm", "qwen2", "llama-bpe", "default", ""])


_EDITS = [
    _edit_value,
    _edit_value,
    _edit_type,
    _edit_keys,
    _edit_tensor,
    _edit_counts,
    _edit_tokenizer,
    _edit_tokenizer,
]


def mutate_gguf(rnd: random.Random, seed: GGUFDoc) -> tuple[bytes, int]:
    """A mutated header (serialized) and its file size; sometimes a byte-level edit on top."""
    header, size = serialize(mutate_doc(rnd, seed) if rnd.random() < 0.9 else seed)
    if rnd.random() < 0.2:
        header = mutate_bytes(rnd, header)
    return header, size
