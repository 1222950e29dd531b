"""The flow's own refusals and pieces: Args validation, masks, cache layout, softcapping, chat template."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from tiny_gemma3 import TINY, TINY_CONFIG

import turbospark_core
from turbospark_core.cache_spec import CacheSpec
from turbospark_core.errors import ArchConfigError
from turbospark_core.kv_cache import causal_mask as _causal_mask

from turbospark_gemma3 import convert, plugin
from turbospark_gemma3.family import Args, _residual

BASE = convert.arch_from_hf(TINY_CONFIG)


def test_valid_arch_has_no_problems() -> None:
    assert Args.problems(BASE) == []
    assert Args.from_arch(BASE).layer_types[2] == "full_attention"


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar"),
        ({"sliding_window": None}, "sliding_window"),
        ({"layer_types": ["sliding_attention"] * 3}, "layer_types"),
        ({"layer_types": ["sliding_attention"] * 3 + ["chunked_attention"]}, "layer_types"),
        ({"hidden_activation": "gelu"}, "hidden_activation"),
        ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping"),
        ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
        ({"rope_local_scaling": {"rope_type": "linear", "factor": 2.0}}, "sliding layers"),
        ({"norm_adds_one": None}, "norm_adds_one"),
    ],
)
def test_unsupported_arch_refused_by_name(change: dict[str, Any], named: str) -> None:
    arch = {**BASE, **change}
    assert any(named in p for p in Args.problems(arch))
    with pytest.raises(ArchConfigError, match=named):
        Args.from_arch(arch)


def test_cache_layout_follows_layer_types() -> None:
    layout = plugin.cache_layout(BASE)
    assert layout == [CacheSpec.sliding(2, 32, 16), CacheSpec.sliding(2, 32, 16), CacheSpec.full(2, 32),
                      CacheSpec.sliding(2, 32, 16)]


@pytest.mark.parametrize(("n", "window"), [(6, 2), (5, 8), (9, 4)])
def test_sliding_mask_without_cache(n: int, window: int) -> None:
    q, k = np.arange(n)[:, None], np.arange(n)[None, :]
    expected = (k <= q) & (k > q - window)
    mask = _causal_mask(n, window)
    got = np.tril(np.ones((n, n), bool)) if isinstance(mask, str) else np.array(mask)
    assert np.array_equal(got, expected)
    assert _causal_mask(1, window) is None and _causal_mask(n, None) == "causal"


def test_float16_residual_does_not_overflow() -> None:
    x = mx.full((4,), 60000.0, mx.float16)
    out = _residual(x, x)
    assert out.dtype == mx.float16 and bool(mx.isfinite(out).all())


def _with_arch(src: Path, dst: Path, **changes: Any) -> Path:
    shutil.copytree(src, dst)
    manifest = json.loads((dst / "manifest.json").read_text())
    manifest["arch"].update(changes)
    (dst / "manifest.json").write_text(json.dumps(manifest))
    return dst


def test_final_logit_softcapping(turbospark_install: Any, tmp_path: Path) -> None:
    src = turbospark_install(TINY)
    ids = [2, 40, 41, 300, 7]
    plain = turbospark_core.open(src).logits(ids)
    capped = turbospark_core.open(_with_arch(src, tmp_path / "capped", final_logit_softcapping=0.5)).logits(ids)
    assert np.allclose(capped, np.tanh(plain / 0.5) * 0.5, atol=1e-6)


def test_default_chat_template_is_gemma_turns(turbospark_install: Any) -> None:
    runner = turbospark_core.open(turbospark_install(TINY))
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "bye"}]
    text = runner.tokenizer.decode(runner.chat_prompt(messages), skip_special_tokens=False)
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\nhi<end_of_turn>\n<start_of_turn>model\nhello<end_of_turn>\n"
        "<start_of_turn>user\nbye<end_of_turn>\n<start_of_turn>model\n"
    )
