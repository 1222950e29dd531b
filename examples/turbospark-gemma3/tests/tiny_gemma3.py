"""A tiny random Gemma 3 checkpoint in Hugging Face layout, with references from mlx-lm's gemma3_text.

Written in the format of the shared reference fixtures (``references.npz`` with
prompt_ids / logits / greedy_tokens / greedy_step_logits / logits_bf16_weights),
so :class:`turbospark_core.testing.FamilyConformance` can run on it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

TINY = "gemma3_tiny"
PROMPT_LEN, GREEDY_STEPS, MIN_MARGIN = 48, 16, 1e-3

# Heads 4/2 with head_dim 32 != hidden/heads; sliding window 16 < the 48-token prompt;
# layers s, s, full, s; non-default rope bases; hidden 64 so sqrt(hidden) = 8 is exact in
# bfloat16 (mlx-lm rounds the embedding scale to bfloat16, transformers does not).
TINY_CONFIG: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 512,
    "rms_norm_eps": 1e-6,
    "query_pre_attn_scalar": 24,
    "sliding_window": 16,
    "sliding_window_pattern": 3,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
    "rope_theta": 500000.0,
    "rope_local_base_freq": 20000.0,
    "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 500000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 20000.0},
    },
    "max_position_embeddings": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "tie_word_embeddings": True,
    "bos_token_id": 2,
    "eos_token_id": 1,
    "pad_token_id": 0,
    "torch_dtype": "float32",
}
SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]


# ------------------------------------------------------------------ the tiny checkpoint
def random_weights(cfg: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    d, f, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hq, hkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]

    def normal(*shape: int, scale: float) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    # Norm weights random around 0 (the flow multiplies by 1 + w): skipping the 1 or a norm fails
    out = {"model.embed_tokens.weight": normal(v, d, scale=0.05), "model.norm.weight": normal(d, scale=0.3)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        out |= {
            f"{p}.self_attn.q_proj.weight": normal(hq * hd, d, scale=0.15),
            f"{p}.self_attn.k_proj.weight": normal(hkv * hd, d, scale=0.15),
            f"{p}.self_attn.v_proj.weight": normal(hkv * hd, d, scale=0.15),
            f"{p}.self_attn.o_proj.weight": normal(d, hq * hd, scale=0.1),
            f"{p}.self_attn.q_norm.weight": normal(hd, scale=0.3),
            f"{p}.self_attn.k_norm.weight": normal(hd, scale=0.3),
            f"{p}.mlp.gate_proj.weight": normal(f, d, scale=0.15),
            f"{p}.mlp.up_proj.weight": normal(f, d, scale=0.15),
            f"{p}.mlp.down_proj.weight": normal(d, f, scale=0.1),
        }
        for norm in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
            out[f"{p}.{norm}_layernorm.weight"] = normal(d, scale=0.3)
    return out


def tokenizer_json(vocab_size: int) -> str:
    """A Gemma-style tokenizer: BPE with byte fallback over "▁"-escaped text, no pre-tokenizer."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        normalizers,
        processors,
    )

    pieces = SPECIALS + [f"<0x{b:02X}>" for b in range(256)] + ["▁", *"abcdefghijklmnopqrstuvwxyz.,"]
    letters = "etaoinshrdlu"
    merges = [("▁", c) for c in letters] + [(a, b) for a in letters[:8] for b in letters[:8]]
    for left, right in merges:
        pieces.append(left + right)
    pieces += [f"<unused{i}>" for i in range(vocab_size - len(pieces))]
    tok = Tokenizer(models.BPE(vocab={p: i for i, p in enumerate(pieces)}, merges=merges, unk_token="<unk>",
                               byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.add_tokens([AddedToken(s, special=True, normalized=False) for s in SPECIALS])
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A", special_tokens=[("<bos>", 2)])
    return tok.to_str()


def _mlx_lm_model(cfg: dict[str, Any], weights: dict[str, np.ndarray]) -> Any:
    import mlx.core as mx
    from mlx_lm.models import gemma3_text

    model = gemma3_text.Model(gemma3_text.ModelArgs.from_dict(cfg))
    model.load_weights(list(model.sanitize({k: mx.array(w) for k, w in weights.items()}).items()))
    return model


def _references(cfg: dict[str, Any], weights: dict[str, np.ndarray], prompt: list[int]) -> dict[str, np.ndarray]:
    """Full-sequence logits and greedy steps, each step a fresh full forward (no cache involved)."""
    import mlx.core as mx

    model = _mlx_lm_model(cfg, weights)

    def logits(ids: list[int]) -> np.ndarray:
        return np.array(model(mx.array([ids]))[0].astype(mx.float32))

    ids, steps = list(prompt), []
    for _ in range(GREEDY_STEPS):
        row = logits(ids)[-1]
        steps.append(row)
        ids.append(int(row.argmax()))
    return {"logits": logits(prompt), "greedy_tokens": np.array(ids[len(prompt):], np.int32),
            "greedy_step_logits": np.stack(steps)}


def _margin(step_logits: np.ndarray) -> float:
    top2 = np.sort(step_logits, axis=-1)[:, -2:]
    return float((top2[:, 1] - top2[:, 0]).min())


def _bf16(weights: dict[str, np.ndarray]) -> dict[str, Any]:
    import mlx.core as mx

    return {k: mx.array(w).astype(mx.bfloat16) for k, w in weights.items()}


class _Edited:
    """An mlx-lm decoder layer whose output gets a steering edit (float32): ``h + add``, then ``h - (h.u)u``."""

    def __init__(self, layer: Any, add: np.ndarray | None, unit: np.ndarray | None) -> None:
        self.layer, self.add, self.unit = layer, add, unit

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        import mlx.core as mx

        h = self.layer(*args, **kwargs)
        if self.add is not None:
            h = h + mx.array(self.add)
        if self.unit is not None:
            u = mx.array(self.unit)
            h = h - (h * u).sum(axis=-1, keepdims=True) * u
        return h


def _steering_references(cfg: dict[str, Any], weights: dict[str, np.ndarray], prompt: list[int],
                         seed: int) -> dict[str, np.ndarray]:
    """steering.npz in the shared fixtures' format, from mlx-lm with each decoder layer wrapped."""
    import mlx.core as mx

    n = cfg["num_hidden_layers"]
    model = _mlx_lm_model(cfg, weights)
    outputs: list[np.ndarray] = []
    layers = model.model.layers
    model.model.layers = [_Recorder(layer, outputs) for layer in layers]
    model(mx.array([prompt]))
    rms = np.array([np.median(np.sqrt((o[0] ** 2).mean(-1))) for o in outputs], np.float32)
    for retry in range(40):
        d = np.random.default_rng(seed + 900 + retry).standard_normal(cfg["hidden_size"])
        d = (d / np.linalg.norm(d)).astype(np.float32)
        out: dict[str, np.ndarray] = {"prompt_ids": np.array(prompt, np.int32), "direction": d, "layer_output_rms": rms}
        edits = {
            "add": ([(n - 1) // 2], None),
            "add2": ([0, n - 1], None),
            "ablate": (list(range(n)), d),
        }
        for key, (chosen, unit) in edits.items():
            scale = np.float32(4 * rms[chosen].mean())
            if key != "ablate":
                out[f"{key}_layers"], out[f"{key}_scale"] = np.array(chosen, np.int32), scale
            model.model.layers = [
                _Edited(layer, scale * d if unit is None and i in chosen else None, unit)
                for i, layer in enumerate(layers)
            ]
            refs = _references_of(model, prompt)
            out |= {f"{key}_{k}": v for k, v in refs.items()}
        if min(_margin(out[f"{k}_greedy_step_logits"]) for k in edits) >= MIN_MARGIN:
            break
    model.model.layers = layers
    return out


class _Recorder:
    def __init__(self, layer: Any, outputs: list[np.ndarray]) -> None:
        self.layer, self.outputs = layer, outputs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        h = self.layer(*args, **kwargs)
        self.outputs.append(np.array(h))
        return h


def _references_of(model: Any, prompt: list[int]) -> dict[str, np.ndarray]:
    import mlx.core as mx

    def logits(ids: list[int]) -> np.ndarray:
        return np.array(model(mx.array([ids]))[0].astype(mx.float32))

    ids, steps = list(prompt), []
    for _ in range(GREEDY_STEPS):
        row = logits(ids)[-1]
        steps.append(row)
        ids.append(int(row.argmax()))
    return {"logits": logits(prompt), "greedy_tokens": np.array(ids[len(prompt):], np.int32),
            "greedy_step_logits": np.stack(steps)}


def build_tiny_fixture(root: Path, cfg: dict[str, Any] = TINY_CONFIG) -> Path:
    """Write ``root/gemma3_tiny`` (checkpoint, bf16/ copy, tokenizer, references.npz, steering.npz); return it."""
    import mlx.core as mx
    from safetensors.numpy import save_file

    out = root / TINY
    (out / "bf16").mkdir(parents=True, exist_ok=True)
    for seed in range(20):  # a seed whose every greedy step leads clearly (no near ties)
        weights = random_weights(cfg, seed)
        rng = np.random.default_rng(1000 + seed)
        prompt = [2, *rng.integers(len(SPECIALS), cfg["vocab_size"], PROMPT_LEN - 1).tolist()]
        refs = _references(cfg, weights, prompt)
        if _margin(refs["greedy_step_logits"]) >= MIN_MARGIN and len(set(refs["greedy_tokens"].tolist())) > 3:
            break
    bf16 = _bf16(weights)
    widened = {k: np.array(w.astype(mx.float32)) for k, w in bf16.items()}
    bf16_refs = _references(cfg, widened, prompt)
    np.savez(out / "references.npz", prompt_ids=np.array(prompt, np.int32), **refs,
             logits_bf16_weights=bf16_refs["logits"], greedy_tokens_bf16_weights=bf16_refs["greedy_tokens"])
    np.savez(out / "steering.npz", **_steering_references(cfg, weights, prompt, seed))
    texts = {
        "config.json": json.dumps(cfg, indent=1),
        "tokenizer.json": tokenizer_json(cfg["vocab_size"]),
        "tokenizer_config.json": json.dumps({"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
                                             "unk_token": "<unk>", "add_bos_token": True}),
        "generation_config.json": json.dumps({"bos_token_id": 2, "eos_token_id": 1, "pad_token_id": 0}),
    }
    for folder in (out, out / "bf16"):
        for name, text in texts.items():
            (folder / name).write_text(text)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    mx.save_safetensors(str(out / "bf16" / "model.safetensors"), bf16, metadata={"format": "pt"})
    (out / "meta.json").write_text(json.dumps({"seed": seed, "greedy_min_margin": _margin(refs["greedy_step_logits"]),
                                               "reference": "mlx-lm gemma3_text, float32, no cache"}))
    return out
