"""A GGUF source through the converter: K-quants of 16-wide sub-blocks stay quantized, exactly.

The K-quant llama GGUF and its float reference (the same values dequantized by
``gguf.quants`` and stored as F32) come from the ``k_quant_*`` fixtures of ``conftest.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

import turbospark_core
from turbospark_core import cli
from turbospark_core.convert import convert
from turbospark_core.errors import ConversionError

PROMPT = [0, *np.random.default_rng(0).integers(2, 258, 40).tolist()]


def _close(got: np.ndarray, want: np.ndarray) -> None:
    # float32 rounding: the quantized kernels and BLAS sum products in other orders
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max()


def test_k_quants_convert_without_dequantizing(k_quant_installs: dict[str, Path]) -> None:
    manifest = json.loads((k_quant_installs["quantized"] / "manifest.json").read_text())
    quant = manifest["quantization"]
    assert "dequantized" not in manifest["provenance"]
    assert quant["model.embed_tokens"] == {"bits": 6, "group_size": 16, "mode": "affine"}  # Q6_K
    assert quant["model.layers.0.self_attn.k_proj"] == {"bits": 3, "group_size": 16, "mode": "affine"}  # Q3_K
    assert quant["lm_head"] == {"bits": 2, "group_size": 16, "mode": "affine"}  # Q2_K
    assert len(quant) == 16  # every matrix of the file
    stored = sum(e["size"] for e in manifest["files"].values())
    reference = json.loads((k_quant_installs["float"] / "manifest.json").read_text())
    assert stored < sum(e["size"] for e in reference["files"].values()) / 3


def test_logits_equal_the_float_reference(k_quant_installs: dict[str, Path]) -> None:
    quantized = turbospark_core.open(k_quant_installs["quantized"])
    reference = turbospark_core.open(k_quant_installs["float"])
    if quantized.opened.policy.native:  # the native kernels multiply every matrix as stored
        assert quantized.opened.estimate.weights == quantized.opened.index.stored_bytes()
    _close(quantized.logits(PROMPT), reference.logits(PROMPT))
    want = reference.generate(PROMPT, max_tokens=8, temperature=0.0).tokens
    assert quantized.generate(PROMPT, max_tokens=8, temperature=0.0).tokens == want


_CHILD = """
import json, sys
import numpy as np
import turbospark_core
from turbospark_core import native
prompt = json.loads(sys.argv[1])
for quantized, reference, budget in json.loads(sys.argv[2]):
    want = turbospark_core.open(reference).logits(prompt)
    runner = turbospark_core.open(quantized, memory_budget=budget, max_context=64)
    got = runner.logits(prompt)
    index, policy = runner.opened.index, runner.opened.policy
    print(json.dumps({
        "native": native.available(), "unpack": policy.unpack, "reason": policy.reason,
        "error": float(np.abs(got - want).max() / np.abs(want).max()),
        "weights": runner.opened.estimate.weights, "float32": index.float_bytes(4), "stored": index.stored_bytes(),
        "narrow": sum(
            index.tensors[f"{b}.{leaf}"].nbytes for b, q in index.quantization.items() if q.group_size == 16
            for leaf in ("weight", "scales", "biases")
        ),
        "narrow_float32": sum(
            4 * int(np.prod(index.logical_shape(b))) for b, q in index.quantization.items() if q.group_size == 16
        ),
    }))
"""


def test_without_native_kernels_mlx_paths_unpack_group_16(
    k_quant_installs: dict[str, Path], k_quant_llama: Callable[..., Path], tmp_path: Path
) -> None:
    """TURBOSPARK_NATIVE=0 in a fresh process: narrow matrices unpacked, under both CPU policies.

    The second install keeps its ``ffn_up`` as Q8_0 (MLX's group 32): a budget between its
    float32 and stored sizes makes the open keep stored form, the policy a GPU gets.
    """
    mixed = {"ffn_up": "Q8_0"}
    convert(k_quant_llama(tmp_path / "m.gguf", dequantized=False, types=mixed), tmp_path / "mixed")
    convert(k_quant_llama(tmp_path / "mf.gguf", dequantized=True, types=mixed), tmp_path / "mixed-float")
    cases = [
        (str(k_quant_installs["quantized"]), str(k_quant_installs["float"]), None),
        (str(tmp_path / "mixed"), str(tmp_path / "mixed-float"), 5_000_000),
    ]
    run = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(PROMPT), json.dumps(cases)],
        capture_output=True, text=True, timeout=300, env={**os.environ, "TURBOSPARK_NATIVE": "0"},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    unpacked, stored = (json.loads(line) for line in run.stdout.splitlines())
    assert not unpacked["native"] and "TURBOSPARK_NATIVE=0" in unpacked["reason"]
    assert unpacked["unpack"] and not stored["unpack"]
    assert unpacked["error"] <= 1e-5 and stored["error"] <= 1e-5
    # the estimate counts what is held: narrow matrices unpacked to float32 under either policy
    assert unpacked["weights"] == unpacked["float32"] > 3 * unpacked["stored"]
    assert stored["weights"] == stored["stored"] - stored["narrow"] + stored["narrow_float32"] < stored["float32"]


def test_strict_accepts_them_and_still_refuses_inexact_types(
    tmp_path: Path, k_quant_llama: Callable[..., Path], capsys: pytest.CaptureFixture[str]
) -> None:
    convert(k_quant_llama(tmp_path / "k.gguf", dequantized=False), tmp_path / "strict", strict=True)
    src = k_quant_llama(tmp_path / "iq.gguf", dequantized=False, types={"ffn_down": "IQ4_NL"})
    with pytest.raises(ConversionError, match=r"--strict.*no exact affine form.*IQ4_NL: blk\.0\.ffn_down\.weight"):
        convert(src, tmp_path / "refused", strict=True)
    assert cli.main(["convert", str(src), str(tmp_path / "dequantized"), "-q"]) == 0
    out = capsys.readouterr().out
    assert "dequantized 2 tensors (IQ4_NL, no exact affine form) to float: blk.0.ffn_down.weight" in out
