"""Tests of qkv.plots: PNG files written atomically, no temporary files left behind."""

from __future__ import annotations

import numpy as np

from qkv.plots import attention_heatmap, loss_curve, mel_comparison

PNG = b"\x89PNG\r\n\x1a\n"


def test_attention_heatmap_writes_a_png(tmp_path):
    rng = np.random.default_rng(0)
    weights = rng.random((5, 4, 6))  # 5 heads: two rows of panels, three of them empty
    weights /= weights.sum(-1, keepdims=True)
    path = tmp_path / "pictures" / "attention.png"  # the folder is created
    result = attention_heatmap(weights, source=list("abcdef"), output=["w", "x", "y", "</s>"], path=path, title="test")
    assert result == path
    assert path.read_bytes().startswith(PNG)
    assert [p.name for p in path.parent.iterdir()] == ["attention.png"]


def test_loss_curve_writes_a_png_and_replaces_an_old_one(tmp_path):
    path = tmp_path / "loss.png"
    path.write_bytes(b"old")
    losses = [3.0 / (1 + 0.1 * i) for i in range(120)]
    assert loss_curve(losses, path, title="loss", ylabel="cross-entropy (nats/token)") == path
    data = path.read_bytes()
    assert data.startswith(PNG) and len(data) > 1000
    assert [p.name for p in tmp_path.iterdir()] == ["loss.png"]


def test_loss_curve_with_a_single_step(tmp_path):
    path = loss_curve([2.5], tmp_path / "one.png", title="one step", ylabel="loss")
    assert path.read_bytes().startswith(PNG)
    assert [p.name for p in tmp_path.iterdir()] == ["one.png"]


def test_mel_comparison_writes_a_png_with_or_without_a_reference(tmp_path):
    rng = np.random.default_rng(0)
    mel = rng.normal(-5.0, 3.0, (40, 16))
    reference = rng.normal(-5.0, 3.0, (55, 16))  # longer than the synthesized one
    reference[:5] = np.log(1e-10)  # floor frames: kept off the colour scale
    path = tmp_path / "tts" / "mel.png"
    assert mel_comparison(mel, reference, path=path, title="test", seconds_per_frame=0.01) == path
    assert path.read_bytes().startswith(PNG)
    alone = mel_comparison(mel, None, path=tmp_path / "tts" / "alone.png", title="alone", seconds_per_frame=0.01)
    assert alone.read_bytes().startswith(PNG)
    assert sorted(p.name for p in path.parent.iterdir()) == ["alone.png", "mel.png"]
