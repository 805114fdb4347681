"""Tests of qkv.training: the schedule, the optimizer step and the training loop."""

from __future__ import annotations

import itertools
import math
import time

import pytest
import torch
from torch import nn

from qkv.errors import UserError
from qkv.losses import seq2seq_batch, sequence_loss
from qkv.models.encoder_decoder import EncoderDecoder, EncoderDecoderConfig
from qkv.training import Trainer, fit, inverse_sqrt, warmup_cosine

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


def _copy_task():
    """step_loss for a fixed copy batch (the target is the source)."""
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(3, V, (int(n),), generator=g).tolist() for n in (4, 6, 5, 3)]
    src, tgt_in, tgt_out = seq2seq_batch([(r, r) for r in rows], pad_id=PAD, bos_id=BOS, eos_id=EOS)
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


def test_trainer_moves_the_model_to_train_device_and_leaves_it_without() -> None:
    model = nn.Linear(3, 5)
    assert Trainer(model, lr=0.1, warmup=1, total_steps=2, device="cpu").model is model
    assert next(model.parameters()).device.type == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match=r"train\.device is cuda, but this torch sees no CUDA GPU"):
            Trainer(nn.Linear(3, 5), lr=0.1, warmup=1, total_steps=2, device="cuda")


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
