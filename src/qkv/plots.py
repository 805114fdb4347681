"""Pictures: attention heatmaps (text, and speech under its spectrogram) and training-loss
curves, written as PNG with matplotlib.

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


def speech_attention(
    mel: np.ndarray,
    weights: np.ndarray,
    *,
    output: list[str],
    seconds_per_frame: float,
    path: str | Path,
    title: str,
) -> Path:
    """A speech model's cross-attention under the utterance's log-mel spectrogram, on one time
    axis (seconds): each output token's row shows which stretch of the audio it read. The
    weights are the heads' mean (a trained model's heads split the work; their mean shows the
    alignment).

    Shapes:
        mel: (T, M) features; weights: (H, L, S) attention weights A' over the S encoder frames
        (L = len(output)); the encoder frames span the same audio as the T feature frames.
    """
    frames = mel.shape[0]
    duration = frames * seconds_per_frame
    mean = weights.mean(axis=0)  # (L, S)
    width = min(16.0, max(6.0, 2.0 * duration + 3.0))
    height = 2.2 + max(1.5, 0.22 * len(output))
    fig = Figure(figsize=(width, height), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[2.2, max(1.5, 0.22 * len(output))])
    top.imshow(mel.T, origin="lower", aspect="auto", cmap="magma", extent=(0, duration, 0, mel.shape[1]))
    top.set_ylabel("mel bin", fontsize=8)
    top.set_title(title, fontsize=10)
    image = bottom.imshow(mean, aspect="auto", cmap="viridis", vmin=0.0, extent=(0, duration, len(output), 0))
    bottom.set_yticks([i + 0.5 for i in range(len(output))], output, fontsize=7)
    bottom.set_ylabel("output token", fontsize=8)
    bottom.set_xlabel("time (s)", fontsize=8)
    fig.colorbar(image, ax=bottom, shrink=0.9, label="mean attention A'")
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
