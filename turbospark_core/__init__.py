"""turbospark: an LLM inference runtime on MLX whose model families are plugins."""

from __future__ import annotations

from turbospark_core import blas

blas.activate()  # before anything imports mlx: MLX's CPU matmuls then use OpenBLAS

from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import TYPE_CHECKING, Any, Literal, TypeVar  # noqa: E402

import pluggy  # noqa: E402

from turbospark_core.errors import TurbosparkError  # noqa: E402
from turbospark_core.names import NAME  # noqa: E402

if TYPE_CHECKING:
    from typing_extensions import Never

    from turbospark_core.options import Distributed, ExpertSlots, KVQuant, Residency
    from turbospark_core.steering import DirectionSet

__version__ = "0.1.0"

_F = TypeVar("_F", bound=Callable[..., Any])
hookimpl: Callable[[_F], _F] = pluggy.HookimplMarker(NAME)


def open(  # noqa: A001 - the API's name
    path: str | Path,
    *,
    max_context: int | None = None,
    expert_slots: ExpertSlots = "auto",
    residency: Residency = "auto",
    memory_budget: int | str | None = None,
    kv_quant: KVQuant | None = None,
    session_slots: int = 1,
    ring_capacity: int | None = None,
    warmup: bool = False,
    router_histogram: bool = False,
    ffn_histogram: bool = False,
    verify: bool = False,
    steering: str | Path | DirectionSet | None = None,
    kv_rotate: bool = True,
    kv_recent: int | None = None,
    vision: str | Path | None = None,
    draft_model: str | Path | None = None,
    ngram: int | None = None,
    mtp: int | Literal["auto"] | None = None,
    num_draft_tokens: int | None = None,
    dflash: str | Path | None = None,
    distributed: Distributed | None = None,
    **unknown: Never,
) -> Runner:
    """Open a turbospark install and return a :class:`Runner`.

    The one description of the open options (the CLI, the server and
    :class:`~turbospark_core.options.OpenOptions` refer here).

    Args:
        path: The install directory (made by ``turbospark convert``).
        max_context: The most tokens a sequence may hold (default: the model's
            ``max_position_embeddings``, at most 8192).
        expert_slots: Routed MoE experts held per layer when streamed: a
            positive count, or ``"auto"`` (the fewest that fit the budget).
        residency: Routed MoE experts: ``"resident"`` (all in memory),
            ``"streamed"`` (an LRU of ``expert_slots`` per layer read from
            ``experts.bin``) or ``"auto"`` (resident when the budget allows).
        memory_budget: Bytes, or a string such as ``"8GB"``/``"512MiB"``
            (default: 80% of the memory free now); an open that would exceed
            it is refused naming the knob to turn.
        kv_quant: ``None``, ``"q8"`` or ``"q4"``: keys and values stored
            affine-quantized (the family may refuse).
        session_slots: Parked conversations kept (see :meth:`Runner.session`);
            the memory estimate counts KV at ``max_context`` for each.
        ring_capacity: Sliding-window layers: ring size in tokens (default
            and minimum: the window).
        warmup: Run one token through the model before returning.
        router_histogram: MoE installs: count, per routed layer and expert,
            the selections and routing-weight mass of everything run after
            the open (:meth:`Runner.router_histogram`); refused on a model
            without routed experts. Off: nothing is allocated or computed.
        ffn_histogram: Per layer, a fixed-bin histogram of the FFN's
            intermediate activations, the input of the down projection
            (:meth:`Runner.ffn_histogram`). Off: nothing is allocated.
            With either histogram on, the family's flow runs uncompiled
            (an ``mx.compile`` trace cannot record).
        verify: Check the sha256 of every file in the manifest's file table
            before anything reads it (off by default: it reads every byte);
            a mismatch raises ``FileTableError`` naming the file.
        steering: A direction set applied to every request that names none
            (open step 14): a ``.safetensors`` direction file, a llama.cpp /
            repeng ``.gguf`` control vector, or a
            :class:`~turbospark_core.steering.DirectionSet`. Checked against
            the model (hidden size, layer range); a family whose flow cannot
            apply it refuses by name.
        kv_rotate: With ``kv_quant``, store keys and values rotated per head by
            a normalized Hadamard transform (rotated back when read, so the
            attention is unchanged in exact math; 4-bit KV loses far less).
            Applies to head dims that are powers of two; ``False`` turns it off.
        kv_recent: With ``kv_quant``, attention reads each query's most recent
            ``kv_recent`` tokens unquantized (every token is still stored
            quantized; the recent ones are also kept exact in a small ring per
            layer, counted by the memory estimate). ``None``: 32 for ``"q4"``
            (SmolLM2 perplexity +0.2% over unquantized instead of +4.2%), 0 for
            ``"q8"``; ``0`` turns it off.
        vision: A vision sidecar directory (``turbospark convert SRC DST --vision
            SIDECAR``) to attach after the open: chat messages may then hold
            images. It must fit the install (family, hidden size, placeholder
            ids) and the tower counts against ``memory_budget``; a family with
            no vision flow refuses it by name (see :meth:`Runner.attach_vision`).
        draft_model: Speculative decoding with a draft model (open step 12):
            the path of another install with the same vocabulary (checked:
            a mismatch is refused naming it), opened with this open's
            ``max_context``, ``kv_quant``, ``kv_rotate``, ``kv_recent``, ``residency``,
            ``expert_slots``, ``memory_budget``, ``ring_capacity``,
            ``verify`` and ``warmup``; it runs unsteered. It proposes tokens,
            the model checks them in one forward: greedy output is identical
            to plain decoding's, sampled output is distributed as plain
            sampling's (speculative sampling). At most one drafter:
            ``draft_model`` and ``ngram`` together are refused; an install
            with a ``hadamard`` section refuses every drafter.
        ngram: Speculative decoding by prompt lookup: propose up to ``ngram``
            tokens (at most 32) copied from where the context's latest tokens
            occurred before (the prompt and the output so far). No extra model.
        mtp: Speculative decoding with the install's own multi-token-prediction
            head (Qwen 3.5 / 3.6 checkpoints carry one): draft up to ``mtp``
            tokens (at most 32) per verify by chaining the head, or ``"auto"``:
            use the head when the install has one (1 token per verify by
            default), else decode plainly. The head is read and built only
            when asked: without ``mtp`` an install with a head opens exactly
            as one without. A depth on an install without a head, or on a
            family whose plugin has no head flow, is refused naming what is
            missing. ``mtp`` with another drafter is refused, except
            ``mtp="auto"`` beside ``dflash``: only the DFlash drafter opens.
        num_draft_tokens: The most tokens drafted per verify (at most 32;
            default: ``ngram``'s or ``mtp``'s value, 4 for a draft model). Left out, the
            drafted count adapts to the measured acceptance and cost (fewer,
            or none for a while, when drafts do not pay); given, every step
            drafts that many. Needs a drafter.
        dflash: Speculative decoding with a DFlash block-diffusion drafter:
            the path of a drafter install (``turbospark convert`` of a z-lab
            ``DFlashDraftModel`` checkpoint) trained for this model. Checked
            at open: its hidden size must equal the model's, its
            ``target_layer_ids`` must be layers of the model, its mask token
            must be in the vocabulary. Each verify, it drafts a block of
            ``block_size - 1`` tokens (the default ``num_draft_tokens``) in
            one forward that reads the model's outputs of those layers (captured
            only while it is open) and uses the model's embedding and LM head.
            With another drafter it is refused (``mtp="auto"`` yields to it).
        distributed: ``"tensor"`` or ``"pipeline"``: in a process started by
            ``mlx.launch``, split the model over ``mx.distributed.init()``'s group
            (see ``docs/distributed.md``). ``"tensor"``: every rank holds a share
            of each layer's heads, of the MLP columns, of the vocabulary rows and
            of each routed layer's experts (expert parallelism), as the family's
            ``distributed_plan`` declares; ``"pipeline"``: every rank runs a
            contiguous range of decoder layers. Each rank reads only its own byte
            ranges of the install, and the memory guard counts only its share.
            Every rank must make the same calls (``logits``, ``generate``...),
            which return the full result on every rank. In a group of one
            process (no ``mlx.launch``) nothing changes. Refused: a family
            without a plan for the mode, a split the group size cannot make
            (the message names the numbers), histograms, ``vision``, and a
            drafter without a fixed ``num_draft_tokens``.
        **unknown: Refused: a misspelled option raises ``OptionError`` naming it.

    Raises:
        TurbosparkError: A subclass naming what is wrong and how to fix it
            (``OptionError`` for a bad or unknown option, checked once the
            path is known to be an install and before its manifest is read).

    Note:
        MLX streams are per thread: use the Runner on the thread that opened
        it (``turbospark serve`` opens and runs on one worker thread).
    """
    from turbospark_core.loader import open_install, refuse_non_install
    from turbospark_core.options import OpenOptions

    refuse_non_install(Path(path))  # step 1 first: a sidecar is refused as one, whatever the options
    options = OpenOptions.from_kwargs(  # step 2
        {
            **unknown,
            "max_context": max_context,
            "expert_slots": expert_slots,
            "residency": residency,
            "memory_budget": memory_budget,
            "kv_quant": kv_quant,
            "session_slots": session_slots,
            "ring_capacity": ring_capacity,
            "warmup": warmup,
            "router_histogram": router_histogram,
            "ffn_histogram": ffn_histogram,
            "verify": verify,
            "steering": steering,
            "kv_rotate": kv_rotate,
            "kv_recent": kv_recent,
            "vision": vision,
            "draft_model": draft_model,
            "ngram": ngram,
            "mtp": mtp,
            "num_draft_tokens": num_draft_tokens,
            "dflash": dflash,
            "distributed": distributed,
        }
    )
    opened = open_install(path, options, tokenizer=True)  # steps 3-15, the tokenizer before the weights
    assert opened.tokenizer is not None
    runner = Runner(opened, opened.tokenizer)
    if options.vision is not None:
        runner.attach_vision(options.vision)
    return runner


from turbospark_core.runner import Generation, Runner  # noqa: E402

__all__ = ["Generation", "Runner", "TurbosparkError", "__version__", "hookimpl", "open"]
