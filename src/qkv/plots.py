"""Pictures: attention heatmaps and training-loss curves, written as PNG with matplotlib.

Both writers are atomic (a temporary file renamed into place). What is not here: computing
attention weights (``generation.py`` / the models) or losses (``training.py``).
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure  # a bare Figure: no pyplot global state, no display

from qkv.files import write_atomic


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110, bbox_inches="tight")
    write_atomic(path, png.getvalue())
    return path


def attention_heatmap(
    weights: np.ndarray, *, source: list[str], output: list[str], path: str | Path, title: str
) -> Path:
    """One panel per head: output tokens down the rows, source tokens along the columns.

    Shapes:
        weights: (H, T, S) attention weights A', T = len(output), S = len(source).
    """
    heads = weights.shape[0]
    cols = min(heads, 4)
    rows = (heads + cols - 1) // cols
    width = max(3.0, 0.38 * len(source) + 1.6)
    height = max(2.5, 0.32 * len(output) + 1.2)
    fig = Figure(figsize=(cols * width, rows * height), layout="constrained")  # no overlapping labels
    axes = fig.subplots(rows, cols, squeeze=False)
    for h in range(rows * cols):
        ax = axes[h // cols][h % cols]
        if h >= heads:
            ax.axis("off")
            continue
        image = ax.imshow(weights[h], cmap="viridis", vmin=0.0, vmax=1.0, aspect="auto")
        ax.set_xticks(range(len(source)), source, rotation=90, fontsize=8)
        ax.set_yticks(range(len(output)), output, fontsize=8)
        ax.set_title(f"head {h + 1}", fontsize=9)
        ax.set_xlabel("source token", fontsize=8)
        if h % cols == 0:
            ax.set_ylabel("output token", fontsize=8)
    fig.colorbar(image, ax=axes, shrink=0.8, label="attention weight A'")
    fig.suptitle(title, fontsize=10)
    return _save(fig, Path(path))


def loss_curve(losses: list[float], path: str | Path, *, title: str) -> Path:
    """Training loss per step (log scale), with a moving average."""
    fig = Figure(figsize=(6, 3.5))
    ax = fig.subplots()
    ax.plot(losses, alpha=0.35, label="loss")
    window = max(1, len(losses) // 50)
    if len(losses) > window:
        smooth = [sum(losses[i - window : i]) / window for i in range(window, len(losses) + 1)]
        ax.plot(range(window - 1, len(losses)), smooth, label=f"mean of {window}")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title, fontsize=10)
    ax.legend()
    return _save(fig, Path(path))
