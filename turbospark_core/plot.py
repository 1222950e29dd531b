"""Pictures of the diagnostics and benchmarks (``turbospark plot``, ``turbospark bench --plot``).

matplotlib is an optional extra (``pip install 'turbospark[plot]'``); it is
imported only here, and only when a picture is asked for. Figures are drawn
with the Agg canvas directly (no pyplot state, no display needed).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from turbospark_core.errors import TurbosparkError

if TYPE_CHECKING:
    from matplotlib.figure import Figure

EXTRA = "pip install 'turbospark[plot]'"


class PlotUnavailableError(TurbosparkError, ImportError):
    """matplotlib (the ``plot`` extra) is not installed."""


def _figure(width: float, height: float) -> Figure:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        msg = f"drawing pictures needs matplotlib, which is not installed; install the plot extra: {EXTRA}"
        raise PlotUnavailableError(msg) from None
    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _save(fig: Figure, out: str | Path) -> Path:
    path = Path(out)
    fig.savefig(path, format="png")
    return path


def plot_histograms(npz: str | Path, out: str | Path) -> Path:
    """Draw an ``.npz`` of ``turbospark generate --router-hist/--ffn-hist`` as ``out`` (PNG).

    The router histogram becomes a layers x experts heatmap of selection
    shares; the FFN histograms become one curve per layer.
    """
    try:
        with np.load(npz) as data:
            arrays = {k: data[k] for k in data.files}
    except (OSError, ValueError) as e:
        msg = f"{npz} is not a histogram .npz ({e}); write one with `turbospark generate ... --router-hist FILE.npz`"
        raise TurbosparkError(msg) from None
    router, ffn = "router_counts" in arrays, "ffn_counts" in arrays
    if not (router or ffn):
        fix = "write one with `turbospark generate ... --router-hist FILE.npz`"
        msg = f"{npz} holds no router_* or ffn_* arrays; {fix}"
        raise TurbosparkError(msg)
    panels = int(router) + int(ffn)
    fig = _figure(10, 4.5 * panels)
    axes = fig.subplots(panels, 1, squeeze=False)[:, 0]
    if router:
        _router_heatmap(fig, axes[0], arrays)
    if ffn:
        _ffn_curves(axes[-1], arrays)
    fig.tight_layout()
    return _save(fig, out)


def _router_heatmap(fig: Figure, ax: Any, arrays: dict[str, np.ndarray]) -> None:
    counts = arrays["router_counts"].astype(np.float64)
    totals = counts.sum(axis=1, keepdims=True)
    share = np.divide(counts, totals, out=np.zeros_like(counts), where=totals > 0)
    image = ax.imshow(share, aspect="auto", interpolation="nearest", cmap="viridis")
    layers = arrays.get("router_layers", np.arange(len(counts)))
    ax.set_yticks(range(len(layers)), [str(int(n)) for n in layers])
    ax.set_xlabel("expert")
    ax.set_ylabel("layer")
    ax.set_title("router: share of each layer's selections per expert")
    fig.colorbar(image, ax=ax, label="share of selections")


def _ffn_curves(ax: Any, arrays: dict[str, np.ndarray]) -> None:
    counts = arrays["ffn_counts"].astype(np.float64)
    layers = arrays.get("ffn_layers", np.arange(len(counts)))
    bins = counts.shape[1]
    centre = bins // 2
    x = np.arange(bins) - centre  # signed bin index: 0 is |x| below the floor
    cmap = _colormap()
    for i, row in enumerate(counts):
        total = row.sum()
        color = cmap(i / max(len(counts) - 1, 1))
        ax.plot(x, row / total if total else row, color=color, label=f"layer {int(layers[i])}")
    edges = arrays.get("ffn_edges")
    if edges is not None and len(edges) == bins + 1:
        ticks = _decade_ticks(edges, centre)
        ax.set_xticks([t for t, _ in ticks], [label for _, label in ticks])
    ax.set_xlabel("FFN intermediate value (signed, log-spaced bins)")
    ax.set_ylabel("share of values")
    ax.set_title("FFN intermediate activations per layer")
    if len(counts) <= 12:
        ax.legend(fontsize="small", ncol=2)


def _decade_ticks(edges: np.ndarray, centre: int) -> list[tuple[int, str]]:
    """Ticks at bins whose edge nearest zero is an even power of ten, and 0 (the centre bin)."""
    ticks = [(0, "0")]
    for offset in range(2, centre + 1):  # offset 1 (the floor) would crowd the 0 tick
        inner = edges[centre + offset]  # the positive bin's lower edge; its mirror has the same magnitude
        power = np.log10(inner) if np.isfinite(inner) and inner > 0 else np.nan
        if np.isfinite(power) and abs(power - round(power)) < 1e-9 and round(power) % 2 == 0:
            label = f"1e{round(power)}"
            ticks += [(offset, label), (-offset, f"-{label}")]
    return sorted(ticks)


def _colormap() -> Any:
    from matplotlib import colormaps

    return colormaps["viridis"]


def plot_bench(rows: Sequence[dict[str, Any]], out: str | Path, title: str = "") -> Path:
    """Prefill and decode tokens/s against prompt length (``turbospark bench --plot``)."""
    fig = _figure(8, 4.5)
    ax = fig.subplots()
    lengths = [r["prompt_tokens"] for r in rows]
    ax.plot(lengths, [r["prefill_tps"] for r in rows], marker="o", label="prefill tok/s")
    ax.plot(lengths, [r["decode_tps"] for r in rows], marker="s", label="decode tok/s")
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("tokens / s")
    ax.set_title(title or "turbospark bench")
    ax.legend()
    fig.tight_layout()
    return _save(fig, out)
