"""Shared fixtures for the core tests: installs converted once per session, copied per test."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from turbospark_core import plugins
from turbospark_core.convert import convert
from turbospark_core.manifest import MANIFEST, WEIGHTS

FIXTURES = Path(
    os.environ.get("TURBOSPARK_FIXTURES", Path(__file__).resolve().parents[2] / "shared" / "fixtures")
)


# ------------------------------------------------------------------ sources
@pytest.fixture(scope="session")
def llama_src() -> Path:
    """The tiny float32 Llama checkpoint (Hugging Face layout)."""
    path = FIXTURES / "llama"
    if not (path / "config.json").is_file():
        pytest.skip(f"reference fixture {path} is not available")
    return path


@pytest.fixture(scope="session")
def references(llama_src: Path) -> dict[str, np.ndarray]:
    """references.npz of the llama fixture (prompt, logits, greedy tokens...)."""
    with np.load(llama_src / "references.npz") as npz:
        return {k: npz[k] for k in npz.files}


# ------------------------------------------------------------------ installs (read-only, per session)
@pytest.fixture(scope="session")
def f32_install(llama_src: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A float32 install of the llama fixture. Never modify it: copy it (``install``)."""
    dst = tmp_path_factory.mktemp("f32") / "install"
    convert(llama_src, dst)
    return dst


@pytest.fixture(scope="session")
def q4_install(llama_src: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A q4 (group 64) install of the llama fixture. Never modify it: copy it."""
    dst = tmp_path_factory.mktemp("q4") / "install"
    convert(llama_src, dst, quantize="q4")
    return dst


@pytest.fixture(scope="session")
def mlx_q4_dir(llama_src: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An mlx-lm directory of the llama fixture, quantized by mlx-lm itself (4 bit, group 32)."""
    mlx_lm = pytest.importorskip("mlx_lm")
    dst = tmp_path_factory.mktemp("mlx_lm") / "model"  # mlx_lm.convert refuses an existing path
    mlx_lm.convert(hf_path=str(llama_src), mlx_path=str(dst), quantize=True, q_group_size=32, q_bits=4)
    return dst


# ------------------------------------------------------------------ per-test copies
@pytest.fixture
def cache_growths(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """``(id(cache), new capacity)`` for each growth of a full-attention KV cache while the test runs."""
    from turbospark_core.kv_cache import KVCache

    grown: list[tuple[int, int]] = []
    grow = KVCache._grow

    def counted(self: KVCache, batch: int, needed: int) -> None:
        before = 0 if self._k is None else self._k.length
        grow(self, batch, needed)
        if self._k is not None and self._k.length != before:
            grown.append((id(self), self._k.length))

    monkeypatch.setattr(KVCache, "_grow", counted)
    return grown


@pytest.fixture
def install(f32_install: Path, tmp_path: Path) -> Path:
    """A private copy of the float32 install that the test may corrupt."""
    dst = tmp_path / "install"
    shutil.copytree(f32_install, dst)
    return dst


@pytest.fixture
def q4_copy(q4_install: Path, tmp_path: Path) -> Path:
    """A private copy of the q4 install that the test may corrupt."""
    dst = tmp_path / "q4"
    shutil.copytree(q4_install, dst)
    return dst


# ------------------------------------------------------------------ tampering helpers
class Tamper:
    """Edits an install the way a corrupt download or a hostile manifest would."""

    @staticmethod
    def manifest(root: Path) -> dict[str, Any]:
        return json.loads((root / MANIFEST).read_text())

    @staticmethod
    def write_manifest(root: Path, raw: Any) -> None:
        (root / MANIFEST).write_text(json.dumps(raw))

    def edit(self, root: Path, fn: Callable[[dict[str, Any]], None]) -> None:
        """Apply ``fn`` to the parsed manifest and write it back."""
        raw = self.manifest(root)
        fn(raw)
        self.write_manifest(root, raw)

    def put_file(self, root: Path, name: str, data: bytes) -> None:
        """Write ``name`` and record its true size and sha256 in the file table."""
        (root / name).write_bytes(data)

        def update(raw: dict[str, Any]) -> None:
            raw["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}

        self.edit(root, update)

    def weights_header(self, root: Path) -> tuple[dict[str, Any], bytes]:
        """The weights file's safetensors header (with ``__metadata__``) and data section."""
        blob = (root / WEIGHTS).read_bytes()
        (n,) = struct.unpack("<Q", blob[:8])
        return json.loads(blob[8 : 8 + n]), blob[8 + n :]

    def put_weights_raw(self, root: Path, header: Any, data: bytes, *, header_bytes: bytes | None = None) -> None:
        """Write a hand-made safetensors container as the install's weights."""
        body = header_bytes if header_bytes is not None else json.dumps(header).encode()
        self.put_file(root, WEIGHTS, struct.pack("<Q", len(body)) + body + data)

    def put_weights(self, root: Path, tensors: dict[str, np.ndarray]) -> None:
        """Rewrite the weights with numpy arrays (any safetensors dtype)."""
        from safetensors.numpy import save

        self.put_file(root, WEIGHTS, save(tensors, metadata={"format": "mlx"}))

    @staticmethod
    def load_weights(root: Path) -> dict[str, np.ndarray]:
        from safetensors.numpy import load_file

        return load_file(str(root / WEIGHTS))


@pytest.fixture(scope="session")
def tamper() -> Tamper:
    return Tamper()


# ------------------------------------------------------------------ plugin state
@pytest.fixture
def no_plugins() -> Iterator[None]:
    """Simulate an environment with no family plugin installed (allow-list empty)."""
    old = os.environ.get(plugins.ALLOW_LIST_ENV)
    os.environ[plugins.ALLOW_LIST_ENV] = ""
    plugins.reset_plugins()
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(plugins.ALLOW_LIST_ENV, None)
        else:
            os.environ[plugins.ALLOW_LIST_ENV] = old
        plugins.reset_plugins()


def assert_names(message: str, *parts: str) -> None:
    """Every part (offender, fix) appears in the refusal message."""
    missing = [p for p in parts if p not in message]
    assert not missing, f"message lacks {missing}: {message}"


@pytest.fixture(scope="session")
def names() -> Callable[..., None]:
    """``names(exc_info_or_message, *parts)``: the refusal names each part."""

    def check(err: Any, *parts: str) -> None:
        message = err if isinstance(err, str) else str(err.value)
        assert_names(message, *parts)

    return check


# ------------------------------------------------------------------ a llama GGUF with 16-wide K-quant sub-blocks
K_QUANT_TYPES = {  # GGUF tensor suffix -> block type (every 16-wide K-quant, on every kind of matrix)
    "token_embd": "Q6_K",  # embedding row gathers
    "output": "Q2_K",  # the untied head
    "attn_q": "Q6_K",  # rotary rows un-permuted on the packed form
    "attn_k": "Q3_K",
    "attn_v": "Q2_K",
    "attn_output": "Q3_K",
    "ffn_gate": "Q2_K",
    "ffn_up": "Q6_K",
    "ffn_down": "Q3_K",
}
_K_QUANT_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q6_K": (208,), "IQ4_NL": (0,), "Q8_0": (0,)}  # d (and dmin)


def _k_quant_blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks with small finite float16 super-scales (gguf has no K-quantizer)."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    for at in _K_QUANT_SCALES[qtype]:
        d = rng.uniform(2e-4, 2e-3, (rows, cols // block)) * rng.choice([-1.0, 1.0], (rows, cols // block))
        raw[..., at : at + 2] = d.astype("<f2")[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def _write_k_quant_llama(path: Path, *, dequantized: bool, types: dict[str, str] | None = None) -> Path:
    """A 2-layer llama GGUF (hidden 256, ffn 512) whose matrices are Q6_K / Q3_K / Q2_K.

    ``dequantized``: the same file with those matrices stored as the F32 values
    ``gguf.quants.dequantize`` gives (the float reference). ``types``: block
    types to use instead of :data:`K_QUANT_TYPES`'s, by tensor suffix.
    """
    import gguf
    from gguf import quants

    hidden, ffn, heads, kv_heads, vocab = 256, 512, 4, 2, 260
    rng = np.random.default_rng(25)
    shapes = {"token_embd": (vocab, hidden), "output": (vocab, hidden)}
    for i in range(2):
        shapes.update({
            f"blk.{i}.attn_q": (hidden, hidden), f"blk.{i}.attn_k": (hidden // 2, hidden),
            f"blk.{i}.attn_v": (hidden // 2, hidden), f"blk.{i}.attn_output": (hidden, hidden),
            f"blk.{i}.ffn_gate": (ffn, hidden), f"blk.{i}.ffn_up": (ffn, hidden), f"blk.{i}.ffn_down": (hidden, ffn),
        })  # fmt: skip
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    pieces = [chr(0x100 + b) for b in range(256)]  # ids alone drive these tests, not text
    w.add_token_list(["<s>", "</s>", *pieces, pieces[0] + pieces[1], pieces[2] + pieces[3]])
    w.add_token_merges([f"{pieces[0]} {pieces[1]}", f"{pieces[2]} {pieces[3]}"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    for name, (rows, cols) in shapes.items():
        suffix = name.rpartition(".")[2]
        qtype = gguf.GGMLQuantizationType[(types or {}).get(suffix, K_QUANT_TYPES[suffix])]
        raw = _k_quant_blocks(qtype.name, rows, cols, rng)
        if dequantized:
            w.add_tensor(f"{name}.weight", quants.dequantize(raw, qtype).astype(np.float32))
        else:
            w.add_tensor(f"{name}.weight", raw, raw_dtype=qtype)
    for norm in ["output_norm", *(f"blk.{i}.{n}" for i in range(2) for n in ("attn_norm", "ffn_norm"))]:
        w.add_tensor(f"{norm}.weight", (1 + 0.1 * rng.standard_normal(hidden)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="session")
def k_quant_llama() -> Callable[..., Path]:
    """``k_quant_llama(path, dequantized=..., types=...)``: writes the K-quant llama GGUF (see above)."""
    return _write_k_quant_llama


@pytest.fixture(scope="session")
def k_quant_installs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``{"gguf", "quantized", "float"}``: the K-quant llama GGUF, its install, and the install of
    its float reference (the same values dequantized by gguf.quants). Never modify them."""
    root = tmp_path_factory.mktemp("k-quants")
    src = _write_k_quant_llama(root / "k.gguf", dequantized=False)
    convert(src, root / "quantized")
    convert(_write_k_quant_llama(root / "f32.gguf", dequantized=True), root / "float")
    return {"gguf": src, "quantized": root / "quantized", "float": root / "float"}
