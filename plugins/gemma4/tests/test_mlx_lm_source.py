"""An mlx-lm (mlx-community layout, quantized) directory converts and serves like the checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import turbospark_core
from turbospark_core.convert import convert


def test_quantized_mlx_lm_directory(turbospark_fixtures: Path, tmp_path: Path) -> None:
    mlx_lm = pytest.importorskip("mlx_lm")
    src = tmp_path / "hf"
    shutil.copytree(turbospark_fixtures / "gemma4_moe", src)
    config = json.loads((src / "config.json").read_text())
    config["vocab_size"] = config["text_config"]["vocab_size"]  # where mlx-lm 0.32.2 reads it
    (src / "config.json").write_text(json.dumps(config))
    mlx_dir = tmp_path / "mlx"
    mlx_lm.convert(str(src), str(mlx_dir), quantize=True, q_group_size=32, q_bits=8)
    manifest = convert(mlx_dir, tmp_path / "install")
    gate = manifest.experts["layers"]["model.layers.0.experts"]["projections"]["gate_proj"]  # switch_glu mapped
    assert gate["quantization"]["bits"] == 8
    refs = np.load(turbospark_fixtures / "gemma4_moe" / "references.npz")
    got = turbospark_core.open(tmp_path / "install").logits(refs["prompt_ids"].tolist())
    assert float((got.argmax(-1) == refs["logits"].argmax(-1)).mean()) >= 0.95
