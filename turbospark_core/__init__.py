"""turbospark: an LLM inference runtime on MLX whose model families are plugins."""

from __future__ import annotations

from turbospark_core import blas

blas.activate()  # before anything imports mlx: MLX's CPU matmuls then use OpenBLAS

from pathlib import Path  # noqa: E402
from typing import Any, Callable, TypeVar  # noqa: E402

import pluggy  # noqa: E402

from turbospark_core.errors import TurbosparkError  # noqa: E402
from turbospark_core.names import NAME  # noqa: E402

__version__ = "0.1.0"

_F = TypeVar("_F", bound=Callable[..., Any])
hookimpl: Callable[[_F], _F] = pluggy.HookimplMarker(NAME)


def open(path: str | Path, **options: Any) -> Runner:  # noqa: A001 - the API's name
    """Open a turbospark install and return a :class:`Runner`.

    Args:
        path: The install directory (made by ``turbospark convert``).
        **options: ``max_context`` (tokens), ``expert_slots`` (positive int or
            ``"auto"``), ``residency`` (``"resident"``/``"streamed"``/``"auto"``:
            routed MoE experts held in memory, or an LRU of ``expert_slots``
            per layer read from ``experts.bin``),
            ``memory_budget`` (bytes or ``"8GB"``; default 80% of free RAM),
            ``kv_quant`` (``None``/``"q8"``/``"q4"``), ``session_slots``,
            ``ring_capacity``, ``warmup`` (bool).

    Raises:
        TurbosparkError: A subclass naming what is wrong and how to fix it.

    Note:
        MLX streams are per thread: use the Runner on the thread that opened
        it (``turbospark serve`` opens and runs on one worker thread).
    """
    from turbospark_core import plugins
    from turbospark_core.loader import open_install
    from turbospark_core.tokenizer import Tokenizer

    opened = open_install(path, **options)
    hooks = plugins.family_hooks(opened.manifest.model_type)
    tokenizer = Tokenizer.from_install(
        opened.manifest.root,
        opened.generation_config,
        lambda: hooks.default_chat_template(opened.manifest.arch),
    )
    return Runner(opened, tokenizer)


from turbospark_core.runner import Generation, Runner  # noqa: E402

__all__ = ["Generation", "Runner", "TurbosparkError", "hookimpl", "open", "__version__"]
