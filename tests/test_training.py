"""Tests of qkv.training: the schedule, the loss, batch assembly and the training loop."""

from __future__ import annotations

import itertools
import math
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qkv.errors import UserError
from qkv.models.encoder_decoder import EncoderDecoder, EncoderDecoderConfig
from qkv.training import (
    Trainer,
    fit,
    inverse_sqrt,
    on_model,
    seq2seq_batch,
    seq2seq_loss,
    sequence_loss,
    symmetric_kl,
    warmup_cosine,
)

PAD, BOS, EOS = 0, 1, 2
V = 13


def test_inverse_sqrt_warmup_then_decay():
    warmup = 8
    for step in range(1, warmup + 1):
        assert inverse_sqrt(step, warmup=warmup) == pytest.approx(step / warmup)
    assert inverse_sqrt(warmup, warmup=warmup) == pytest.approx(1.0)
    for step in (9, 16, 32, 1000):
        assert inverse_sqrt(step, warmup=warmup) == pytest.approx(math.sqrt(warmup / step))
    # Step 0 is treated as step 1; no warmup is plain 1/sqrt(step).
    assert inverse_sqrt(0, warmup=warmup) == pytest.approx(1 / warmup)
    assert inverse_sqrt(4, warmup=0) == pytest.approx(0.5)


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


def _model(seed: int = 0, *, dropout: float = 0.0) -> EncoderDecoder:
    torch.manual_seed(seed)
    config = EncoderDecoderConfig(
        src_vocab_size=V,
        tgt_vocab_size=V,
        d_model=16,
        n_heads=2,
        d_ff=32,
        n_encoder_layers=1,
        n_decoder_layers=1,
        dropout=dropout,
        max_len=16,
    )
    return EncoderDecoder(config)


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


def _copy_batch():
    """A fixed copy batch (the target is the source): src, tgt_in, tgt_out."""
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(3, V, (int(n),), generator=g).tolist() for n in (4, 6, 5, 3)]
    return seq2seq_batch([(r, r) for r in rows], pad_id=PAD, bos_id=BOS, eos_id=EOS)


def _copy_task():
    """step_loss for a fixed copy batch (the target is the source)."""
    src, tgt_in, tgt_out = _copy_batch()
    n_tokens = int((tgt_out != PAD).sum())

    def step_loss(model, step):
        return sequence_loss(model(src, tgt_in), tgt_out, ignore_id=PAD), n_tokens

    return step_loss, n_tokens


def test_fit_lowers_the_loss_and_counts_steps_and_tokens():
    step_loss, n_tokens = _copy_task()
    model = _model()
    result = fit(model, step_loss, steps=40, lr=1e-2, warmup=5, progress=False)
    assert result.steps == 40 and len(result.losses) == 40
    assert result.tokens == 40 * n_tokens
    assert result.seconds > 0
    assert sum(result.losses[-5:]) / 5 < 0.5 * result.losses[0]
    assert not model.training  # fit leaves the model in eval mode


def test_fit_with_zero_seconds_stops_after_one_step():
    step_loss, n_tokens = _copy_task()
    result = fit(_model(), step_loss, steps=50, lr=1e-2, warmup=5, seconds=0.0, progress=False)
    assert result.steps == 1 and len(result.losses) == 1 and result.tokens == n_tokens


def test_fit_is_deterministic_for_a_seed():
    step_loss, _ = _copy_task()
    a, b = _model(seed=3), _model(seed=3)
    ra = fit(a, step_loss, steps=10, lr=1e-2, warmup=3, progress=False)
    rb = fit(b, step_loss, steps=10, lr=1e-2, warmup=3, progress=False)
    assert ra.losses == rb.losses
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    # and training changed the weights
    fresh = _model(seed=3).state_dict()
    assert any(not torch.equal(sa[k], fresh[k]) for k in sa)


def test_warmup_cosine_rises_then_decays_to_zero() -> None:
    """Linear warmup to 1, monotone cosine decay, 0 at the last step."""
    from qkv.training import warmup_cosine

    factors = [warmup_cosine(s, warmup=5, total=23) for s in range(24)]
    assert factors[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert all(a >= b for a, b in itertools.pairwise(factors[4:]))
    assert factors[23] == pytest.approx(0.0, abs=1e-12)


def test_fit_refuses_an_unknown_schedule() -> None:
    model = torch.nn.Linear(3, 5)
    with pytest.raises(ValueError, match="schedule"):
        fit(model, lambda m, s: (m(torch.ones(2, 3)).sum(), 1), steps=1, lr=1e-3, warmup=1, schedule="step")


def test_replan_ends_the_cosine_at_the_new_total():
    model = nn.Linear(3, 5)
    trainer = Trainer(model, lr=0.1, warmup=2, total_steps=97, schedule="cosine", min_lr=0.01)

    def batch():
        return model(torch.ones(1, 3)).sum(), 1

    for _ in range(11):
        trainer.step([batch])
    before = trainer.lr
    trainer.replan(23)
    # The next step's rate is on the new curve (lower: less road left), and the curve ends at min_lr.
    assert trainer.lr == pytest.approx(0.1 * warmup_cosine(11, warmup=2, total=23, floor=0.1)) and trainer.lr < before
    for _ in range(12):
        trainer.step([batch])
    assert trainer.lr == pytest.approx(0.01)
    trainer.replan(15)  # never before the steps taken: the schedule has ended
    assert trainer.total_steps == 23 and trainer.lr == pytest.approx(0.01)
    trainer.replan(61)  # the cap lets the run go further: the road comes back, gradually
    assert trainer.total_steps == 61
    assert trainer.lr == pytest.approx(0.1 * warmup_cosine(23, warmup=2, total=61, floor=0.1))
    trainer.replan(200)  # never past the steps it was made for
    assert trainer.total_steps == 97


def test_time_cap_anneals_instead_of_stopping_at_a_high_rate():
    model = nn.Linear(3, 5)

    def slow_step(m, step):
        time.sleep(0.004)  # at most ~250 steps/s: far fewer than 100,000 steps fit in the cap
        return m(torch.ones(1, 3)).pow(2).mean(), 1

    result = fit(model, slow_step, steps=100_000, lr=0.1, warmup=5, schedule="cosine", seconds=0.8, progress=False)
    assert 25 <= result.steps < 1000
    # Where the cap stopped it, the schedule was near its end (without shortening: 0.1, the peak).
    assert result.lr < 0.1 / 3


def test_time_cap_that_does_not_bind_changes_nothing():
    torch.manual_seed(0)
    a, b = nn.Linear(3, 5), nn.Linear(3, 5)
    b.load_state_dict(a.state_dict())

    def step_loss(m, step):
        return m(torch.full((1, 3), float(step))).pow(2).mean(), 1

    fit(a, step_loss, steps=53, lr=0.01, warmup=5, schedule="cosine", progress=False)
    fit(b, step_loss, steps=53, lr=0.01, warmup=5, schedule="cosine", seconds=600, progress=False)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_batches_built_on_the_cpu_move_to_the_models_device() -> None:
    """train.device puts the model on a GPU while batches are built on the CPU: the losses move
    them to the model's device (shown with the meta device, which every torch has)."""
    model = nn.Linear(3, 5).to("meta")
    x, none, ids = on_model(model, torch.ones(2, 3), None, torch.tensor([1, 2]))
    assert x.device.type == "meta" and ids.device.type == "meta" and none is None
    assert torch.equal(on_model(nn.Linear(3, 5), torch.ones(2, 3))[0], torch.ones(2, 3))


def test_trainer_moves_the_model_to_train_device_and_leaves_it_without() -> None:
    model = nn.Linear(3, 5)
    assert Trainer(model, lr=0.1, warmup=1, total_steps=2, device="cpu").model is model
    assert next(model.parameters()).device.type == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match=r"train\.device is cuda, but this torch sees no CUDA GPU"):
            Trainer(nn.Linear(3, 5), lr=0.1, warmup=1, total_steps=2, device="cuda")


# A linear loss s_t·Σ(W·x): its gradient s_t·[x; x] is the same whatever the weights, so its norm
# s_t·|x|·√2 is known before each step.
CLIP_X = torch.tensor([[0.2, -0.4, 0.4]])  # |x| = 0.6
CLIP_SCALES = [3.0, 0.5, 7.0, 0.2, 2.0, 0.9, 11.0, 0.3]  # gradient norms 2.5, 0.42, 5.9, 0.17, 1.7, 0.76, 9.3, 0.25


def _fit_linear(scales: list[float], clip: float) -> torch.Tensor:
    torch.manual_seed(0)
    model = nn.Linear(3, 2, bias=False)
    fit(
        model,
        lambda m, step: (scales[step] * m(CLIP_X).sum(), 1),
        steps=len(scales),
        lr=0.1,
        warmup=1,
        weight_decay=0.0,
        clip=clip,
        progress=False,
    )
    return model.weight.detach()


def test_clipping_scales_each_gradient_to_the_clip_norm_and_leaves_smaller_ones() -> None:
    """With clip c, each step's update is the one of the gradient g·min(1, c/|g|) (Pascanu et al.,
    2013): training on the clipped gradients given unclipped (clip=0) ends at the same weights, while
    the gradients as they are end elsewhere (AdamW reads their relative sizes). Gradients already
    within c are used as they are, to the bit."""
    c = 1.0
    norm = CLIP_X.norm().item() * math.sqrt(2)
    clipped = _fit_linear(CLIP_SCALES, clip=c)
    by_hand = [s * min(1.0, c / (s * norm)) for s in CLIP_SCALES]  # the gradient times min(1, c/|g|)
    torch.testing.assert_close(clipped, _fit_linear(by_hand, clip=0.0), rtol=1e-5, atol=1e-6)
    assert (clipped - _fit_linear(CLIP_SCALES, clip=0.0)).abs().max() > 1e-2  # clipping changed the run
    small = [s for s in CLIP_SCALES if s * norm < c]
    assert len(small) == 4 and torch.equal(_fit_linear(small, clip=c), _fit_linear(small, clip=0.0))


def test_bf16_autocast_trains_in_bf16_with_fp32_weights_and_fp32_like_losses() -> None:
    """bf16=True runs the forward pass under bf16 autocast (the logits are bf16), keeps the weights
    fp32 (mixed precision, Micikevicius et al., 2018), and its losses are finite, within 1% of an
    fp32 run's from the same weights and falling."""
    step_loss, _ = _copy_task()
    dtypes: dict[bool, set] = {False: set(), True: set()}
    losses = {}
    for bf16 in (False, True):
        model = _model(seed=5)

        def watched(m, step, bf16=bf16):
            dtypes[bf16].add(m(*_copy_batch()[:2]).dtype)  # what the forward pass computes in
            return step_loss(m, step)

        losses[bf16] = fit(model, watched, steps=6, lr=1e-2, warmup=2, bf16=bf16, progress=False).losses
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        assert {s.dtype for s in model.state_dict().values() if s.is_floating_point()} == {torch.float32}
    assert dtypes == {False: {torch.float32}, True: {torch.bfloat16}}
    assert all(math.isfinite(loss) for loss in losses[True])
    assert losses[True] == pytest.approx(losses[False], rel=1e-2)
    assert losses[True][-1] < 0.9 * losses[True][0]
