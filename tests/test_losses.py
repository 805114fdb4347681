"""Tests of qkv.losses: cross-entropy, batch assembly, the encoder-decoder loss and R-Drop."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qkv.losses import on_model, seq2seq_batch, seq2seq_loss, sequence_loss, symmetric_kl
from test_training import _model  # the same tiny encoder-decoder (V = 13)

PAD, BOS, EOS = 0, 1, 2
V = 13


def _logits_and_targets():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, V, generator=g)
    targets = torch.tensor([[5, 6, 7, EOS, PAD], [8, EOS, PAD, PAD, PAD]])
    return logits, targets


def test_sequence_loss_is_cross_entropy_of_non_pad_tokens():
    logits, targets = _logits_and_targets()
    loss = sequence_loss(logits, targets, ignore_id=PAD)
    keep = targets != PAD
    assert loss.item() == pytest.approx(F.cross_entropy(logits[keep], targets[keep]).item(), rel=1e-6)


def test_sequence_loss_ignores_padded_positions():
    logits, targets = _logits_and_targets()
    changed = logits.clone()
    changed[targets == PAD] = torch.randn_like(changed[targets == PAD]) * 100
    assert torch.equal(sequence_loss(logits, targets, ignore_id=PAD), sequence_loss(changed, targets, ignore_id=PAD))
    # Without ignore_id every position counts, so the change shows.
    assert sequence_loss(logits, targets, ignore_id=None) != sequence_loss(changed, targets, ignore_id=None)


def test_label_smoothing_penalises_a_confident_correct_prediction():
    targets = torch.tensor([[3, 4, EOS]])
    logits = torch.full((1, 3, V), -10.0)
    logits[0, torch.arange(3), targets[0]] = 10.0
    plain = sequence_loss(logits, targets, ignore_id=PAD)
    smoothed = sequence_loss(logits, targets, ignore_id=PAD, label_smoothing=0.1)
    assert plain.item() < 1e-6
    assert smoothed.item() > plain.item() + 0.5


def test_seq2seq_batch_shapes_padding_bos_eos():
    pairs = [([5, 6, 7], [8, 9]), ([5], [8, 9, 10, 11])]
    src, tgt_in, tgt_out = seq2seq_batch(pairs, pad_id=PAD, bos_id=BOS, eos_id=EOS)
    assert src.shape == (2, 3) and tgt_in.shape == (2, 5) and tgt_out.shape == (2, 5)
    assert src.dtype == tgt_in.dtype == tgt_out.dtype == torch.long
    assert src.tolist() == [[5, 6, 7], [5, PAD, PAD]]
    assert tgt_in.tolist() == [[BOS, 8, 9, PAD, PAD], [BOS, 8, 9, 10, 11]]
    assert tgt_out.tolist() == [[8, 9, EOS, PAD, PAD], [8, 9, 10, 11, EOS]]
    # The decoder input is the expected output shifted right by one.
    assert torch.equal(tgt_in[1, 1:], tgt_out[1, :-1])


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_seq2seq_loss_equals_the_loss_over_all_positions(smoothing: float) -> None:
    """Logits at real target tokens only (the fast path) give the loss, count and gradients of
    logits everywhere with padding ignored (the explicit path)."""
    g = torch.Generator().manual_seed(3)
    rows = [torch.randint(3, V, (int(n),), generator=g).tolist() for n in (4, 7, 2)]
    src, tgt_in, tgt_out = seq2seq_batch([(r, r[::-1]) for r in rows], pad_id=PAD, bos_id=BOS, eos_id=EOS)
    model = _model()
    fast, n = seq2seq_loss(model, src, tgt_in, tgt_out, pad_id=PAD, label_smoothing=smoothing)
    fast.backward()
    fast_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    explicit = sequence_loss(model(src, tgt_in), tgt_out, ignore_id=PAD, label_smoothing=smoothing)
    explicit.backward()
    assert n == int((tgt_out != PAD).sum()) == 4 + 7 + 2 + 3
    assert fast.item() == pytest.approx(explicit.item(), rel=1e-6)
    for a, b in zip(fast_grads, (p.grad for p in model.parameters()), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_symmetric_kl_is_both_directions_of_kl_div() -> None:
    g = torch.Generator().manual_seed(5)
    logp = torch.log_softmax(torch.randn(7, V, generator=g, dtype=torch.float64), -1)
    logq = torch.log_softmax(torch.randn(7, V, generator=g, dtype=torch.float64), -1)
    # F.kl_div(input, target) is KL(target ‖ input), summed over the vocabulary per row.
    reference = F.kl_div(logq, logp, log_target=True, reduction="batchmean") + F.kl_div(
        logp, logq, log_target=True, reduction="batchmean"
    )
    torch.testing.assert_close(symmetric_kl(logp, logq), reference)
    torch.testing.assert_close(symmetric_kl(logq, logp), reference)
    assert symmetric_kl(logp, logp).item() == 0.0


def _rdrop_batch():
    g = torch.Generator().manual_seed(4)
    rows = [torch.randint(3, V, (int(n),), generator=g).tolist() for n in (5, 2, 7)]
    return seq2seq_batch([(r, r[::-1]) for r in rows], pad_id=PAD, bos_id=BOS, eos_id=EOS)


def test_rdrop_without_dropout_is_the_plain_loss() -> None:
    """With no dropout the two copies agree: the KL term vanishes and loss and gradients are
    those of the plain loss."""
    src, tgt_in, tgt_out = _rdrop_batch()
    model = _model()
    rdrop, n = seq2seq_loss(model, src, tgt_in, tgt_out, pad_id=PAD, label_smoothing=0.1, rdrop=5.0)
    rdrop.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    plain, m = seq2seq_loss(model, src, tgt_in, tgt_out, pad_id=PAD, label_smoothing=0.1)
    plain.backward()
    assert n == m == int((tgt_out != PAD).sum())
    assert rdrop.item() == pytest.approx(plain.item(), rel=1e-6)
    for a, b in zip(grads, (p.grad for p in model.parameters()), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_rdrop_with_dropout_is_the_papers_loss() -> None:
    """In training mode each copy draws its own masks; the loss is the mean cross-entropy of
    both copies plus alpha/4 of the symmetric KL between them (Liang et al., 2021, eq. 3 over
    the copies' tokens), recomputed here from the same masks (same seed) the explicit way."""
    src, tgt_in, tgt_out = _rdrop_batch()
    model = _model(dropout=0.3).train()
    alpha = 3.0
    torch.manual_seed(11)
    loss, n = seq2seq_loss(model, src, tgt_in, tgt_out, pad_id=PAD, label_smoothing=0.1, rdrop=alpha)
    torch.manual_seed(11)
    logits = model(torch.cat([src, src]), torch.cat([tgt_in, tgt_in]))  # (2B, T, V)
    keep = tgt_out != PAD
    p1, p2 = logits[: len(src)][keep], logits[len(src) :][keep]  # (N, V) each
    ce = (
        sequence_loss(p1[None], tgt_out[keep][None], ignore_id=None, label_smoothing=0.1)
        + sequence_loss(p2[None], tgt_out[keep][None], ignore_id=None, label_smoothing=0.1)
    ) / 2
    l1, l2 = torch.log_softmax(p1, -1), torch.log_softmax(p2, -1)
    kl = F.kl_div(l2, l1, log_target=True, reduction="sum") + F.kl_div(l1, l2, log_target=True, reduction="sum")
    assert n == int(keep.sum())
    assert kl.item() > 0  # dropout made the copies differ
    assert loss.item() == pytest.approx((ce + alpha / 4 * kl / n).item(), rel=1e-5)


def test_batches_built_on_the_cpu_move_to_the_models_device() -> None:
    """train.device puts the model on a GPU while batches are built on the CPU: the losses move
    them to the model's device (shown with the meta device, which every torch has)."""
    model = nn.Linear(3, 5).to("meta")
    x, none, ids = on_model(model, torch.ones(2, 3), None, torch.tensor([1, 2]))
    assert x.device.type == "meta" and ids.device.type == "meta" and none is None
    assert torch.equal(on_model(nn.Linear(3, 5), torch.ones(2, 3))[0], torch.ones(2, 3))


@pytest.mark.parametrize("family", ["speech_encoder_decoder", "tts"])
def test_shares_with_the_whole_batchs_counts_add_up_to_the_whole_batch(family: str) -> None:
    """Speech and TTS losses mix means over different counts. Computed on two shares of a batch
    with the whole batch's counts and weighted by their frames (share_loss), they give the whole
    batch's loss and gradients, which a step on two workers then takes (test_distributed.py)."""
    from distributed_cases import ROWS, case

    model, loss = case(family)
    whole, _ = loss(model, list(range(ROWS)))
    whole.backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    shares = [loss(model, list(range(r, ROWS, 2))) for r in (0, 1)]
    together = sum(value * count for value, count in shares) / sum(count for _, count in shares)
    together.backward()
    assert together.item() == pytest.approx(whole.item(), rel=1e-6)
    for p, g in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=1e-5, atol=1e-6)
