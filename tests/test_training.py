"""Tests of qkv.training and qkv.schedules: the schedule, the optimizer step and the training loop."""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import math
import time

import pytest
import torch
from torch import nn

from qkv.errors import UserError
from qkv.losses import seq2seq_batch, seq2seq_loss, sequence_loss
from qkv.models.encoder_decoder import EncoderDecoder, EncoderDecoderConfig
from qkv.schedules import inverse_sqrt, warmup_cosine
from qkv.training import (
    Checkpointing,
    Epochs,
    FitConfig,
    FitResult,
    Trainer,
    Validation,
    fit,
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
    result = fit(model, step_loss, FitConfig(steps=40, lr=1e-2, warmup=5), progress=False)
    assert result.steps == 40 and len(result.losses) == 40
    assert result.tokens == 40 * n_tokens
    assert result.seconds > 0
    assert sum(result.losses[-5:]) / 5 < 0.5 * result.losses[0]
    assert not model.training  # fit leaves the model in eval mode


def test_fit_with_zero_seconds_stops_after_one_step():
    step_loss, n_tokens = _copy_task()
    result = fit(_model(), step_loss, FitConfig(steps=50, lr=1e-2, warmup=5, seconds=0.0), progress=False)
    assert result.steps == 1 and len(result.losses) == 1 and result.tokens == n_tokens


def test_fit_is_deterministic_for_a_seed():
    step_loss, _ = _copy_task()
    a, b = _model(seed=3), _model(seed=3)
    ra = fit(a, step_loss, FitConfig(steps=10, lr=1e-2, warmup=3), progress=False)
    rb = fit(b, step_loss, FitConfig(steps=10, lr=1e-2, warmup=3), progress=False)
    assert ra.losses == rb.losses
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    # and training changed the weights
    fresh = _model(seed=3).state_dict()
    assert any(not torch.equal(sa[k], fresh[k]) for k in sa)


def test_warmup_cosine_rises_then_decays_to_zero() -> None:
    """Linear warmup to 1, monotone cosine decay, 0 at the last step."""
    factors = [warmup_cosine(s, warmup=5, total=23) for s in range(24)]
    assert factors[:5] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert all(a >= b for a, b in itertools.pairwise(factors[4:]))
    assert factors[23] == pytest.approx(0.0, abs=1e-12)


def test_fit_refuses_an_unknown_schedule() -> None:
    model = torch.nn.Linear(3, 5)
    with pytest.raises(ValueError, match="schedule"):
        fit(model, lambda m, s: (m(torch.ones(2, 3)).sum(), 1), FitConfig(steps=1, lr=1e-3, warmup=1, schedule="step"))


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

    result = fit(
        model, slow_step, FitConfig(steps=100_000, lr=0.1, warmup=5, schedule="cosine", seconds=0.8), progress=False
    )
    assert 25 <= result.steps < 1000
    # Where the cap stopped it, the schedule was near its end (without shortening: 0.1, the peak).
    assert result.lr < 0.1 / 3


def test_time_cap_that_does_not_bind_changes_nothing():
    torch.manual_seed(0)
    a, b = nn.Linear(3, 5), nn.Linear(3, 5)
    b.load_state_dict(a.state_dict())

    def step_loss(m, step):
        return m(torch.full((1, 3), float(step))).pow(2).mean(), 1

    fit(a, step_loss, FitConfig(steps=53, lr=0.01, warmup=5, schedule="cosine"), progress=False)
    fit(b, step_loss, FitConfig(steps=53, lr=0.01, warmup=5, schedule="cosine", seconds=600), progress=False)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_trainer_moves_the_model_to_train_device_and_leaves_it_without() -> None:
    model = nn.Linear(3, 5)
    assert Trainer(model, lr=0.1, warmup=1, total_steps=2, device="cpu").model is model
    assert next(model.parameters()).device.type == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match=r"train\.device is cuda, but this torch sees no CUDA GPU"):
            Trainer(nn.Linear(3, 5), lr=0.1, warmup=1, total_steps=2, device="cuda")


def _model(seed: int = 0, *, dropout: float = 0.0, bias: bool = True) -> EncoderDecoder:
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
        bias=bias,
    )
    return EncoderDecoder(config)


B, K = 3, 4  # rows per batch, batches accumulated per step


def _rows(step: int) -> list[list[int]]:
    """The K·B rows of step ``step``'s copy batch, of lengths 2 to 8 (so K batches of B rows hold
    different numbers of tokens: a mean of their means would weight them wrongly)."""
    g = torch.Generator().manual_seed(step)
    return [
        torch.randint(3, V, (int(torch.randint(2, 9, (1,), generator=g)),), generator=g).tolist() for _ in range(K * B)
    ]


def _copy_loss(model: EncoderDecoder, rows: list[list[int]]) -> tuple[torch.Tensor, int]:
    src, tgt_in, tgt_out = seq2seq_batch([(r, r) for r in rows], pad_id=PAD, bos_id=BOS, eos_id=EOS)
    return seq2seq_loss(model, src, tgt_in, tgt_out, pad_id=PAD)


def test_accumulating_four_batches_of_b_equals_one_batch_of_4b() -> None:
    """train.accumulate: a step over K batches of B rows (batch i: part i % K of step i // K's
    rows) has the loss, gradient and update of one step over the K·B rows at once. No biases: a
    key bias's true gradient is zero, and AdamW would move it by ±lr on rounding noise alone."""
    whole = _model(seed=2, bias=False)
    parts = _model(seed=2, bias=False)
    config = FitConfig(steps=3, lr=1e-2, warmup=1)
    one = fit(whole, lambda m, step: _copy_loss(m, _rows(step)), config, progress=False)

    def part(m: EncoderDecoder, i: int) -> tuple[torch.Tensor, int]:
        return _copy_loss(m, _rows(i // K)[(i % K) * B : (i % K + 1) * B])

    four = fit(parts, part, dataclasses.replace(config, accumulate=K), progress=False)
    assert one.tokens == four.tokens and len(four.losses) == 3
    assert four.losses == pytest.approx(one.losses, rel=1e-5)
    for p, q in zip(whole.parameters(), parts.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-6)  # the last step's gradient
        torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6)
    # The parts differ in size: the plain mean of their losses is not the step's loss.
    fresh = _model(seed=2)
    means = [_copy_loss(fresh, _rows(0)[k * B : (k + 1) * B])[0].item() for k in range(K)]
    assert abs(sum(means) / K - one.losses[0]) > 1e-3


def test_ema_is_the_moving_average_of_the_weights_after_every_step() -> None:
    """train.ema_decay d: the model fit returns holds e_N, e_0 = the initial weights and
    e_t = d·e_(t−1) + (1 − d)·θ_t, computed here by hand from the weights of a run without it
    (the average does not change training: the same losses)."""
    d, seen = 0.75, []

    def step_loss(m: EncoderDecoder, step: int) -> tuple[torch.Tensor, int]:
        seen.append([p.detach().clone() for p in m.parameters()])  # θ_step: the weights before the step
        return _copy_loss(m, _rows(step)[:B])

    config = FitConfig(steps=6, lr=1e-2, warmup=1)
    plain = _model(seed=4)
    raw = fit(plain, step_loss, config, progress=False)
    thetas = [*seen, [p.detach().clone() for p in plain.parameters()]]  # θ_0 … θ_6
    hand = thetas[0]
    for theta in thetas[1:]:
        hand = [d * e + (1 - d) * t for e, t in zip(hand, theta, strict=True)]
    averaged, validated = _model(seed=4), []

    def score(m: EncoderDecoder) -> dict[str, float]:  # validation reads the average
        validated.append([p.detach().clone() for p in m.parameters()])
        return {"loss": 0.0}

    validation = Validation(score=score, metric="loss", higher=False, every=3)
    result = fit(averaged, step_loss, dataclasses.replace(config, ema_decay=d), progress=False, validation=validation)
    assert result.losses == raw.losses
    partial = thetas[0]
    for theta in thetas[1:4]:
        partial = [d * e + (1 - d) * w for e, w in zip(partial, theta, strict=True)]
    for v, e in zip(validated[0], partial, strict=True):  # after step 3: e_3
        torch.testing.assert_close(v, e, rtol=1e-6, atol=1e-7)
    for p, e in zip(averaged.parameters(), hand, strict=True):
        torch.testing.assert_close(p.detach(), e, rtol=1e-6, atol=1e-7)
    assert any(not torch.allclose(p, last) for p, last in zip(averaged.parameters(), thetas[-1], strict=True))


def test_a_run_continued_from_its_saved_state_ends_as_an_uninterrupted_one() -> None:
    """With accumulation and a moving average: the trainer's state after step 4 (optimizer,
    schedule, the average) restored into a fresh model continues to the same weights, bit for bit."""
    config = FitConfig(steps=9, lr=1e-2, warmup=2, schedule="cosine", accumulate=2, ema_decay=0.8)
    saved: dict[int, tuple] = {}

    def part(m: EncoderDecoder, i: int) -> tuple[torch.Tensor, int]:
        return _copy_loss(m, _rows(i)[:B])

    def save(trainer: Trainer, result: FitResult) -> str:
        weights = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        saved[result.steps] = (trainer.state(), weights, copy.deepcopy(result))
        return "memory"

    whole = _model(seed=6)
    uninterrupted = fit(whole, part, config, progress=False, checkpoint=Checkpointing(save=save, every=4))
    assert sorted(saved) == [4, 8]

    def load(trainer: Trainer) -> FitResult:
        (tensors, meta), weights, result = saved[4]
        trainer.model.load_state_dict(weights)
        trainer.restore(tensors, json.loads(json.dumps(meta)))  # as a checkpoint stores it
        return copy.deepcopy(result)

    resumed = _model(seed=7)  # other weights: the state must bring them all back
    again = fit(resumed, part, config, progress=False, checkpoint=Checkpointing(save=save, load=load))
    assert again.losses == uninterrupted.losses
    assert all(torch.equal(p, q) for p, q in zip(whole.parameters(), resumed.parameters(), strict=True))
    tensors, _ = saved[8][0]
    assert {f"ema.{i}" for i in range(len(list(whole.parameters())))} <= set(tensors)


def _line_loss(m: nn.Module, i: int) -> tuple[torch.Tensor, int]:
    return (m(torch.full((1, 3), float(i % 7))) - 1.0).pow(2).mean(), 1


def test_validation_keeps_the_best_and_the_last_k_and_stops_on_patience() -> None:
    """Validation every 2 steps with scripted scores (a loss: lower is better): the best is saved
    when it improves, the last 2 validated checkpoints are kept (older ones dropped), two
    validations without a better score stop the run, and every score reaches the scalars."""
    scripted = iter([5.0, 4.0, 4.5, 4.2, 3.0])
    kept, dropped, tags = [], [], []
    checkpoint = Checkpointing(
        save=lambda trainer, result: "memory",
        keep=lambda name, scores: kept.append((name, scores["loss"])),
        drop=dropped.append,
    )
    validation = Validation(
        score=lambda m: {"loss": next(scripted)}, metric="loss", higher=False, every=2, patience=2, keep=2
    )
    torch.manual_seed(0)
    result = fit(
        nn.Linear(3, 5),
        _line_loss,
        FitConfig(steps=20, lr=0.01, warmup=1),
        progress=False,
        checkpoint=checkpoint,
        validation=validation,
        scalars=lambda tag, value, step: tags.append((tag, step)),
    )
    assert (result.steps, result.stopped_by) == (8, "patience")
    assert [h["step"] for h in result.history] == [2, 4, 6, 8] and [h["valid_loss"] for h in result.history] == [
        5,
        4,
        4.5,
        4.2,
    ]
    assert result.best["step"] == 4 and result.bad == 2
    assert [k for k in kept if k[0] == "best"] == [("best", 5.0), ("best", 4.0)]
    assert [k[0] for k in kept if k[0] != "best"] == [f"step-{s:07d}" for s in (2, 4, 6, 8)]
    assert dropped == ["step-0000002", "step-0000004"] and result.kept == ["step-0000006", "step-0000008"]
    assert ("valid/loss", 6) in tags and ("train/loss", 1) in tags and ("train/lr", 1) in tags


def test_epochs_take_their_batches_in_groups_and_validate_at_each_end() -> None:
    """A run in epochs: begin(e) is asked for each epoch's batches; with 2 batches accumulated a
    step, an epoch of 5 takes steps of 2, 2 and 1 (never across its end); validation after each
    epoch; the run ends after the epochs; the time validation takes is not training time."""
    begun, seen = [], []

    def begin(epoch: int) -> int:
        begun.append(epoch)
        return 5

    def step_loss(m: nn.Module, b: int) -> tuple[torch.Tensor, int]:
        seen.append(b)
        return _line_loss(m, b)

    def slow_score(m: nn.Module) -> dict[str, float]:
        time.sleep(0.2)
        return {"accuracy": 0.5}

    started = time.perf_counter()
    result = fit(
        nn.Linear(3, 5),
        step_loss,
        FitConfig(steps=None, lr=0.01, warmup=1, accumulate=2),
        progress=False,
        epochs=Epochs(count=3, begin=begin),
        validation=Validation(score=slow_score, metric="accuracy", higher=True),
    )
    wall = time.perf_counter() - started
    assert begun == [0, 0, 1, 2]  # epoch 0 twice: first to plan the schedule's length
    assert seen == [0, 1, 2, 3, 4] * 3
    assert (result.steps, result.epoch, result.batch, result.stopped_by) == (9, 3, 0, "epochs")
    assert [(h["epoch"], h["step"]) for h in result.history] == [(1, 3), (2, 6), (3, 9)]
    assert result.seconds < wall - 3 * 0.2


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
        FitConfig(steps=len(scales), lr=0.1, warmup=1, weight_decay=0.0, clip=clip),
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

        losses[bf16] = fit(model, watched, FitConfig(steps=6, lr=1e-2, warmup=2, bf16=bf16), progress=False).losses
        assert {p.dtype for p in model.parameters()} == {torch.float32}
        assert {s.dtype for s in model.state_dict().values() if s.is_floating_point()} == {torch.float32}
    assert dtypes == {False: {torch.float32}, True: {torch.bfloat16}}
    assert all(math.isfinite(loss) for loss in losses[True])
    assert losses[True] == pytest.approx(losses[False], rel=1e-2)
    assert losses[True][-1] < 0.9 * losses[True][0]
