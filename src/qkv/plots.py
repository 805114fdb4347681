"""Pictures: attention heatmaps (text, and speech under its spectrogram), a synthesized mel
spectrogram beside the reference's (text-to-speech) and training-loss curves, written as PNG
with matplotlib.

Every writer is atomic (a temporary file renamed into place). What is not here: computing
attention weights (``decoding/`` / the models) or losses (``losses.py``).
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


def mel_comparison(
    mel: np.ndarray,
    reference: np.ndarray | None,
    *,
    path: str | Path,
    title: str,
    seconds_per_frame: float,
) -> Path:
    """A synthesized log-mel spectrogram above the reference's (text-to-speech), on one time
    axis (seconds) and one colour scale, so a reader compares them bin for bin; without a
    reference, the synthesized one alone. The two may differ in length: each panel spans its
    own frames, and the axis spans the longer. The colour scale runs from the larger peak down
    80 dB (8·ln 10 in natural-log power), so frames at the features' floor do not wash it out.

    Shapes:
        mel: (T, M) log-mel frames; reference: (T', M) or None.
    """
    panels = [("synthesized", mel)] + ([] if reference is None else [("reference", reference)])
    top = max(float(np.max(m)) for _, m in panels)
    low = max(min(float(np.min(m)) for _, m in panels), top - 8 * np.log(10))  # at most 80 dB of range
    duration = max(m.shape[0] for _, m in panels) * seconds_per_frame
    width = min(16.0, max(6.0, 2.0 * duration + 3.0))
    fig = Figure(figsize=(width, 2.4 * len(panels) + 0.6), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (name, m) in zip(axes, panels, strict=True):
        extent = (0, m.shape[0] * seconds_per_frame, 0, m.shape[1])
        image = ax.imshow(m.T, origin="lower", aspect="auto", cmap="magma", vmin=low, vmax=top, extent=extent)
        ax.set_ylabel(f"{name}\nmel bin", fontsize=8)
    axes[0].set_xlim(0, duration)
    axes[0].set_title(title, fontsize=10)
    axes[-1].set_xlabel("time (s)", fontsize=8)
    fig.colorbar(image, ax=list(axes), shrink=0.9, label="ln mel power")
    return _save(fig, Path(path))


def loss_curve(losses: list[float], path: str | Path, *, title: str, ylabel: str) -> Path:
    """Training loss per step (log scale), with a moving average; ``ylabel`` says what the loss is."""
    fig = Figure(figsize=(6, 3.5))
    ax = fig.subplots()
    ax.plot(losses, alpha=0.35, label="loss")
    window = max(1, len(losses) // 50)
    if len(losses) > window:
        smooth = [sum(losses[i - window : i]) / window for i in range(window, len(losses) + 1)]
        ax.plot(range(window - 1, len(losses)), smooth, label=f"mean of {window}")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)
    ax.legend()
    return _save(fig, Path(path))
