"""Meta-tests over the hookspecs (documented, typed, tested), then one test per hook via llama."""

from __future__ import annotations

import ast
import inspect
import json
import re
import types
import typing
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

import turbospark_core
from turbospark_core import hookspecs, plugins
from turbospark_core.cache_spec import CacheSpec
from turbospark_core.convert.records import TensorTarget
from turbospark_core.names import NAME
from turbospark_core.registry import FamilySpec

ROOT = Path(__file__).resolve().parents[1]
SPECS = {
    name: fn
    for name, fn in vars(hookspecs).items()
    if isinstance(fn, types.FunctionType) and getattr(fn, f"{NAME}_spec", None) is not None
}
FOREIGN = {"model_type": "__not_a_family__", "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 512}


def _firstresult(name: str) -> bool:
    return bool(getattr(SPECS[name], f"{NAME}_spec")["firstresult"])


def _spec_params(names: list[str]) -> list[Any]:
    """Parametrize over hookspecs."""
    return list(names)


# ================================================================== meta-tests


def test_hookspecs_are_found_and_registered() -> None:
    assert len(SPECS) >= 10
    for name in SPECS:
        assert getattr(plugins.pm.hook, name).spec is not None, name
    assert turbospark_core.hookimpl.project_name == plugins.pm.project_name == NAME == "turbospark"


@pytest.mark.parametrize("name", _spec_params(sorted(SPECS)))
def test_hookspec_docstring_says_what_none_means_and_if_firstresult(name: str) -> None:
    doc = inspect.getdoc(SPECS[name]) or ""
    assert doc, f"hookspec {name} has no docstring"
    assert "None" in doc, f"{name}: say what returning None means"
    stops = "Stops at first non-None result" in " ".join(doc.split())  # across line wraps
    assert stops == _firstresult(name), f"{name}: the docstring and firstresult={_firstresult(name)} disagree"
    if not _firstresult(name):
        assert re.search(r"not firstresult|every (plugin|implementation)|all implementations", doc, re.I), name


@pytest.mark.parametrize("name", sorted(SPECS))
def test_hookspec_documents_every_argument(name: str) -> None:
    doc = inspect.getdoc(SPECS[name]) or ""
    assert "Args:" in doc, name
    args_section = doc.split("Args:", 1)[1]
    for param in inspect.signature(SPECS[name]).parameters:
        assert re.search(rf"^\s+{param}:", args_section, re.M), f"{name}: argument {param!r} is undocumented"


def _type_checking_namespace() -> dict[str, Any]:
    """hookspecs' globals plus what it imports under ``if TYPE_CHECKING:``."""
    namespace = dict(vars(hookspecs))
    tree = ast.parse(inspect.getsource(hookspecs))
    for node in tree.body:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            exec(compile(ast.Module(body=node.body, type_ignores=[]), "<TYPE_CHECKING>", "exec"), namespace)
    return namespace


@pytest.mark.parametrize("name", sorted(SPECS))
def test_hookspec_is_fully_annotated(name: str) -> None:
    fn = SPECS[name]
    sig = inspect.signature(fn)
    missing = [p for p, v in sig.parameters.items() if v.annotation is inspect.Parameter.empty]
    assert not missing, f"{name}: unannotated {missing}"
    assert sig.return_annotation is not inspect.Signature.empty, f"{name}: no return annotation"
    hints = typing.get_type_hints(fn, globalns=_type_checking_namespace())  # every name resolves
    assert set(hints) == {*sig.parameters, "return"}
    if _firstresult(name):  # None is how a plugin says "not mine"
        assert type(None) in typing.get_args(hints["return"]), f"{name} must be able to return None"


def _test_sources() -> str:
    files = [*ROOT.glob("tests/**/*.py"), *ROOT.glob("plugins/*/tests/**/*.py")]
    return "\n".join(f.read_text(encoding="utf-8") for f in files)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_hook_has_a_test(name: str) -> None:
    assert re.search(rf"^def test_hook_{name}\b", _test_sources(), re.M), f"write a test_hook_{name}"


# ================================================================== one test per hook, via llama


@pytest.fixture(scope="module")
def hf_config(llama_src: Path) -> dict[str, Any]:
    return json.loads((llama_src / "config.json").read_text())


@pytest.fixture(scope="module")
def arch(hf_config: dict[str, Any]) -> dict[str, Any]:
    out = plugins.arch_from_hf_config(hf_config)
    assert out is not None
    return out


@pytest.fixture(scope="module")
def llama() -> plugins.FamilyHooks:
    return plugins.family_hooks("llama")


@pytest.fixture(scope="module")
def llama_plugin() -> Any:
    """The llama plugin module itself, to see its hookimpls' raw answers."""
    claim = plugins.registry().claim("llama")
    assert claim is not None
    return claim.plugin


def test_hook_register_families() -> None:
    plugins.load_plugins()
    specs: list[FamilySpec] = []
    plugins.pm.hook.register_families(register=specs.append)
    llama = [s for s in specs if s.name == "llama"]
    assert len(llama) == 1 and llama[0] in plugins.registry().families()
    assert {"llama", "qwen2", "qwen3", "qwen3_moe"} <= set(llama[0].model_types)
    assert llama[0].distribution == "turbospark-llama" and "llama" in llama[0].gguf_architectures


def test_hook_arch_from_hf_config(hf_config: dict[str, Any], llama: plugins.FamilyHooks) -> None:
    arch = plugins.arch_from_hf_config(hf_config)  # routed to the plugin claiming the model type
    assert arch is not None and arch == llama.arch_from_hf_config(hf_config)
    assert arch["model_type"] == "llama"
    assert (arch["hidden_size"], arch["num_hidden_layers"], arch["vocab_size"]) == (64, 2, 512)
    assert (arch["num_attention_heads"], arch["num_key_value_heads"], arch["head_dim"]) == (4, 2, 16)
    assert arch["rope_scaling"]["rope_type"] == "llama3"
    json.dumps(arch)  # it goes into manifest.json
    assert plugins.arch_from_hf_config({**hf_config, "model_type": "gpt_neo"}) is None  # no plugin claims it


GGUF_METADATA = {
    "general.architecture": "llama",
    "llama.block_count": 2,
    "llama.embedding_length": 64,
    "llama.feed_forward_length": 160,
    "llama.attention.head_count": 4,
    "llama.attention.head_count_kv": 2,
    "llama.attention.layer_norm_rms_epsilon": 1e-5,
    "llama.context_length": 256,
    "llama.rope.freq_base": 500000.0,
    "llama.vocab_size": 512,
}


def test_hook_arch_from_gguf(llama: plugins.FamilyHooks) -> None:
    arch = plugins.arch_from_gguf("llama", GGUF_METADATA, ["token_embd.weight"])  # routed: llama claims "llama"
    assert arch is not None and arch == llama.arch_from_gguf("llama", GGUF_METADATA, ["token_embd.weight"])
    assert arch["model_type"] == "llama" and arch["tie_word_embeddings"] is True  # no output.weight
    assert (arch["hidden_size"], arch["num_key_value_heads"], arch["head_dim"], arch["vocab_size"]) == (64, 2, 16, 512)
    assert llama.arch_problems(arch) == []
    assert plugins.arch_from_gguf("__not_a_family__", {}, []) is None


def test_hook_hf_tensor_target(arch: dict[str, Any], llama: plugins.FamilyHooks) -> None:
    name = "model.layers.1.self_attn.q_proj.weight"
    assert llama.hf_tensor_target(arch, name) == TensorTarget.to(name)
    assert llama.hf_tensor_target(arch, "model.visual.blocks.0.attn.qkv.weight") == TensorTarget.drop()
    assert llama.hf_tensor_target(arch, "model.layers.0.self_attn.rotary_emb.inv_freq") == TensorTarget.drop()


def test_hook_hf_tensor_transform(arch: dict[str, Any], llama: plugins.FamilyHooks) -> None:
    # llama places every tensor as it is: no rewrite, so hf_tensor_target decides
    data = mx.zeros((64, 64))
    assert llama.hf_tensor_transform(arch, "model.layers.0.self_attn.q_proj.weight", data) is None


def test_hook_gguf_tensor_target(arch: dict[str, Any], llama: plugins.FamilyHooks) -> None:
    assert llama.gguf_tensor_target(arch, "token_embd.weight") == TensorTarget.to("model.embed_tokens.weight")
    q = llama.gguf_tensor_target(arch, "blk.1.attn_q.weight")
    k = llama.gguf_tensor_target(arch, "blk.1.attn_k.weight")
    assert q.name == "model.layers.1.self_attn.q_proj.weight" and q.unpermute_heads == 4
    assert k.unpermute_heads == 2  # rotary rows are un-permuted per KV head
    assert llama.gguf_tensor_target(arch, "blk.0.ffn_down.weight").unpermute_heads is None


def test_hook_arch_problems(arch: dict[str, Any], llama: plugins.FamilyHooks) -> None:
    assert llama.arch_problems(arch) == []
    problems = llama.arch_problems({**arch, "num_attention_heads": 5})
    assert len(problems) == 1 and "num_attention_heads=5" in problems[0] and "num_key_value_heads=2" in problems[0]
    assert any("qk_norm" in p for p in llama.arch_problems({**arch, "qk_norm": "sideways"}))


def test_hook_kv_quant_unsupported_reason(arch: dict[str, Any], llama: plugins.FamilyHooks) -> None:
    # plain softmax attention: llama has no reason to refuse quantized KV
    for kv_quant in ("q8", "q4"):
        assert llama.kv_quant_unsupported_reason(arch, kv_quant) is None


def test_hook_accepts_hadamard(arch: dict[str, Any], llama: plugins.FamilyHooks, llama_plugin: Any) -> None:
    assert llama_plugin.accepts_hadamard(arch=arch) is True  # a bool, not merely truthy
    assert llama.accepts_hadamard(arch) is True


def test_hook_hadamard_residual_map(arch: dict[str, Any], llama: plugins.FamilyHooks) -> None:
    from turbospark_core.hadamard import ResidualMap

    layer = "model.layers.0."
    names = [f"{layer}{n}.weight" for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
             "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "input_layernorm")]
    rmap = llama.hadamard_residual_map(arch, names)
    assert isinstance(rmap, ResidualMap) and rmap.hidden_size == arch["hidden_size"] and rmap.norm_offset == 0.0
    assert rmap.norms[0].readers == tuple(f"{layer}self_attn.{p}_proj.weight" for p in "qkv")
    assert rmap.norms[1].readers == (f"{layer}mlp.gate_proj.weight", f"{layer}mlp.up_proj.weight")
    assert rmap.writers == (f"{layer}self_attn.o_proj.weight", f"{layer}mlp.down_proj.weight")
    assert (rmap.embedding, rmap.head, rmap.final_norm) == (
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
    )


def test_hook_steering_supported(arch: dict[str, Any], llama: plugins.FamilyHooks, llama_plugin: Any) -> None:
    assert llama_plugin.steering_supported(arch=arch) is None  # None: the flow applies the edits
    assert llama.steering_supported(arch) is None


def test_hook_distributed_plan(arch: dict[str, Any], llama: plugins.FamilyHooks) -> None:
    plan = llama.distributed_plan(arch)
    assert plan is not None and plan.tensor is not None and plan.pipeline is not None
    assert plan.tensor.per_rank == ("num_attention_heads", "num_key_value_heads")
    assert plan.tensor.splits["*.self_attn.o_proj"].axis == "in"
    assert plugins.family_hooks("dummy_lm").distributed_plan({"model_type": "dummy_lm"}) is None  # no hook


def test_hook_cache_layout(arch: dict[str, Any], llama: plugins.FamilyHooks) -> None:
    assert llama.cache_layout(arch) == (CacheSpec.full(n_kv_heads=2, head_dim=16),) * 2


def test_hook_default_chat_template(arch: dict[str, Any], llama: plugins.FamilyHooks) -> None:
    # llama installs carry their checkpoint's template; the family offers no default
    assert llama.default_chat_template(arch) is None


def test_hook_build_family_state(f32_install: Path, arch: dict[str, Any]) -> None:
    runner = turbospark_core.open(f32_install)
    model = runner.model
    assert len(model.layers) == arch["num_hidden_layers"]
    out = model(mx.array([[1, 2, 3]]), runner.opened.new_cache())
    assert out.shape == (1, 3, 512)
