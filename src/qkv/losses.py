"""Losses: what each model family is trained to minimise, and the batches they read.

What is here: :func:`sequence_loss` (token cross-entropy with label smoothing, padding
ignored), :func:`seq2seq_batch` (padded source, decoder input starting with BEGIN, targets
ending with END), :func:`seq2seq_loss` (an encoder-decoder's loss with logits at real target
tokens only, with R-Drop as an option), :func:`ctc_loss` and :func:`speech_loss` (a speech
model's CTC loss, and CTC and cross-entropy mixed), :func:`guided_attention_loss` and
:func:`tts_loss` (a text-to-speech model's frame, stop-token and alignment losses),
:func:`mask_tokens` (BERT's masked-LM corruption: 15% of the tokens selected, 80/10/10
mask/random/kept) and :func:`on_model` (a batch built on the CPU moved to the model's device).
On N workers a loss whose terms are means over different counts (speech, TTS) takes the whole
batch's counts (:func:`speech_tokens`, :func:`tts_counts`) and :func:`share_loss` weights each
worker's part, so that the step is the whole batch's.

What is not here: the optimizer, the schedule and the training loop (``training.py``), models,
decoding, data files.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def on_model(model: nn.Module, *tensors: Tensor | None) -> tuple[Tensor | None, ...]:
    """``tensors`` moved to the device ``model``'s parameters are on (a batch is built on the
    CPU; ``train.device`` may have put the model on a GPU). None stays None."""
    device = next(model.parameters()).device
    return tuple(t if t is None else t.to(device, non_blocking=True) for t in tensors)


def sequence_loss(logits: Tensor, targets: Tensor, *, ignore_id: int | None, label_smoothing: float = 0.0) -> Tensor:
    """Mean cross-entropy per target token; ``ignore_id`` (padding) positions do not count.

    Label smoothing spreads ``label_smoothing`` of the target mass uniformly over the
    vocabulary (Szegedy et al., 2016; Vaswani et al., section 5.4).

    Shapes: logits (B, T, V), targets (B, T) -> scalar.
    """
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),  # (B*T, V)
        targets.reshape(-1),  # (B*T,)
        ignore_index=-100 if ignore_id is None else ignore_id,
        label_smoothing=label_smoothing,
    )


def symmetric_kl(logp: Tensor, logq: Tensor) -> Tensor:
    """Mean over rows of KL(P‖Q) + KL(Q‖P), from log-probabilities.

    KL(P‖Q) + KL(Q‖P) = Σᵥ (pᵥ − qᵥ)(log pᵥ − log qᵥ): one sum, never negative, zero
    only when the rows agree.

    Shapes: logp, logq (N, V) -> scalar.
    """
    return ((logp.exp() - logq.exp()) * (logp - logq)).sum(-1).mean()


def seq2seq_loss(
    model: nn.Module,
    src: Tensor,
    tgt_in: Tensor,
    tgt_out: Tensor,
    *,
    pad_id: int,
    label_smoothing: float = 0.0,
    rdrop: float = 0.0,
) -> tuple[Tensor, int]:
    """Mean cross-entropy per real target token of an encoder-decoder, and their count.

    The same value as :func:`sequence_loss` over all positions with ``ignore_id=pad_id``,
    but logits are computed at the real target tokens only (the model's ``only``), so
    padding costs no output-layer work.

    ``rdrop`` > 0 adds R-Drop (Liang et al., NeurIPS 2021, eq. 3): the batch goes through
    the model twice in one forward pass (stacked, so each copy draws its own dropout
    masks), and the loss is the mean cross-entropy of both copies plus
    ``rdrop``/4 · (KL(P₁‖P₂) + KL(P₂‖P₁)) per token -- the paper's
    NLL₁ + NLL₂ + α/2 · (KL₁₂ + KL₂₁) divided by the two copies' tokens, as its fairseq
    criterion normalises it, so α means what the paper's α does. Without dropout (eval
    mode) the copies agree and the loss equals the plain one. The count is the batch's
    own tokens (each seen twice). The training loss logged then includes the KL term, so
    its curve is not comparable with a run without R-Drop (validation loss is the plain one).

    Shapes: src (B, S), tgt_in and tgt_out (B, T) as :func:`seq2seq_batch` returns them.
    """
    src, tgt_in, tgt_out = on_model(model, src, tgt_in, tgt_out)
    keep = tgt_out != pad_id  # (B, T)
    n = int(keep.sum())
    copies = 2 if rdrop > 0.0 else 1  # R-Drop: copy 1's rows, then copy 2's
    only = keep.repeat(copies, 1)  # (copies·B, T)
    logits = model(src.repeat(copies, 1), tgt_in.repeat(copies, 1), only=only)  # (copies·N, V)
    targets = tgt_out[keep].repeat(copies)  # (copies·N,)
    loss = sequence_loss(logits[None], targets[None], ignore_id=None, label_smoothing=label_smoothing)
    if copies == 2:
        logp = torch.log_softmax(logits.float(), dim=-1)  # (2N, V)
        loss = loss + rdrop / 4 * symmetric_kl(logp[:n], logp[n:])
    return loss, n


def ctc_loss(
    logits: Tensor, valid: Tensor, targets: Tensor, target_lengths: Tensor, *, blank: int, per: int | None = None
) -> Tensor:
    """CTC loss (Graves et al., 2006) per target token: −Σ_b log p(y_b | x_b) divided by
    the batch's target tokens Σ_b |y_b| (or by ``per``: a whole batch's, of which these rows are
    one worker's share, :func:`share_loss`).

    Per target token, so that it is on the scale of the cross-entropy :func:`speech_loss` mixes
    it with (torch's ``reduction="mean"`` divides each utterance by its own length, ESPnet by the
    batch size). Each utterance reads its real frames only (``valid``); one whose target cannot
    be aligned to them (too few frames) counts zero, not infinity (``zero_infinity``).

    Shapes: logits (B, S, V) of a CTC head; valid (B, S) bool; targets (B, L), row b's tokens
    its first ``target_lengths[b]`` (no BEGIN, no END); target_lengths (B,) -> scalar.
    """
    log_probs = torch.log_softmax(logits.float(), dim=-1).transpose(0, 1)  # (S, B, V)
    total = F.ctc_loss(
        log_probs, targets, valid.sum(1), target_lengths, blank=blank, reduction="sum", zero_infinity=True
    )
    return total / (target_lengths.sum().clamp(min=1) if per is None else max(per, 1))


def speech_loss(
    model: nn.Module,
    features: Tensor,
    valid: Tensor,
    t_in: Tensor,
    t_out: Tensor,
    *,
    pad_id: int,
    ctc_weight: float = 0.3,
    label_smoothing: float = 0.0,
    whole: tuple[int, int] | None = None,
) -> tuple[Tensor, int]:
    """The joint CTC/attention loss of a speech encoder-decoder, λ·CTC + (1 − λ)·cross-entropy
    (Kim, Hori & Watanabe, 2017, "Joint CTC-attention based end-to-end speech recognition using
    multi-task learning"), both per target token, and the count of real target tokens.

    The encoder runs once for both terms. The cross-entropy is :func:`seq2seq_loss`'s (logits
    at the real target tokens only, END included, label smoothing); the CTC term is
    :func:`ctc_loss` over the transcript, ``t_out``'s real tokens without END. λ = 0 needs no
    CTC head; λ = 1 skips the decoder.

    The two terms are means over different counts (END is a cross-entropy target, not a CTC
    one), so a batch split over workers cannot be put together by weighting each share's loss
    by one count. ``whole`` (:func:`speech_tokens` of the whole batch, these rows one worker's
    share of it) divides each term's sum by the whole batch's count instead: the loss returned
    is this share's part of the whole batch's, and the parts add up to it (:func:`share_loss`).

    Shapes: features (B, T, M), valid (B, T) bool, t_in and t_out (B, L) as
    :func:`seq2seq_batch` returns them (targets only) -> scalar, count.
    """
    if not 0.0 <= ctc_weight <= 1.0:
        raise ValueError(f"ctc_weight must be in [0, 1], got {ctc_weight}")
    features, valid, t_in, t_out = on_model(model, features, valid, t_in, t_out)
    keep = t_out != pad_id  # (B, L)
    n = int(keep.sum())
    memory, memory_valid = model.encode(features, valid)  # (B, S, D), (B, S)
    loss = memory.new_zeros((), dtype=torch.float32)
    if ctc_weight < 1.0:
        logits = model.decode(t_in, memory, src_mask=memory_valid, only=keep).logits  # (N, V)
        attention = sequence_loss(logits[None], t_out[keep][None], ignore_id=None, label_smoothing=label_smoothing)
        if whole is not None:  # this share's part of the whole batch's mean
            attention = attention * (n / max(whole[0], 1))
        loss = loss + (1.0 - ctc_weight) * attention
    if ctc_weight > 0.0:
        lengths = (keep & (t_out != model.config.eos_id)).sum(1)  # (B,): the transcript, END left out
        per = whole[1] if whole is not None else None
        ctc = ctc_loss(model.ctc_logits(memory), memory_valid, t_out, lengths, blank=model.config.blank, per=per)
        loss = loss + ctc_weight * ctc
    return loss, n


def speech_tokens(t_out: Tensor, *, pad_id: int, eos_id: int) -> tuple[int, int]:
    """The counts :func:`speech_loss`'s terms are means over: real target tokens (END included:
    the cross-entropy's) and transcript tokens (END left out: CTC's).

    Shapes: t_out (B, L) as :func:`seq2seq_batch` returns it -> two counts.
    """
    keep = t_out != pad_id  # (B, L)
    return int(keep.sum()), int((keep & (t_out != eos_id)).sum())


def share_loss(part: Tensor, count: float, whole: float) -> Tensor:
    """One worker's part of a whole batch's loss (a loss computed with the whole batch's counts,
    ``whole=``) as the loss :meth:`~qkv.training.Trainer.step` weights by the worker's own count:
    part · whole / count. The count-weighted mean over the workers, Σ part_w · whole / Σ count_w,
    is then Σ part_w, the whole batch's loss: a step on N workers is the step on the whole batch
    even for a loss whose terms are means over different counts. One process (count = whole):
    the part itself.
    """
    return part if count == whole or count <= 0 else part * (whole / count)


def guided_attention_weights(
    text_lengths: Tensor, step_lengths: Tensor, *, sigma: float = 0.2, size: tuple[int, int] | None = None
) -> Tensor:
    """The penalty W of guided attention (Tachibana et al., 2018, eq. 4):
    W[u, s] = 1 − exp(−(s / S_b − u / U_b)² / (2σ²)) inside each utterance's U_b decoder steps
    and S_b text positions, 0 outside (padding is never penalised). Near the diagonal W ≈ 0.

    Shapes: text_lengths (B,), step_lengths (B,) -> (B, U, S): ``size`` (U, S), or the longest
    (rows cut from a batch padded for longer ones keep its padding: a worker's share).
    """
    steps_size, texts_size = size if size is not None else (int(step_lengths.max()), int(text_lengths.max()))
    u = torch.arange(steps_size, device=text_lengths.device)[None, :, None]  # (1, U, 1)
    s = torch.arange(texts_size, device=text_lengths.device)[None, None, :]  # (1, 1, S)
    steps = step_lengths[:, None, None].float()  # (B, 1, 1)
    texts = text_lengths[:, None, None].float()  # (B, 1, 1)
    w = 1.0 - torch.exp(-((s / texts - u / steps) ** 2) / (2 * sigma**2))  # (B, U, S)
    return w * ((u < steps) & (s < texts))  # (B, U, S)


def guided_attention_loss(
    weights: Tensor, text_lengths: Tensor, step_lengths: Tensor, *, sigma: float = 0.2, cells: int | None = None
) -> Tensor:
    """Guided attention loss (Tachibana et al., 2018, section 4.1): the mean over heads and over
    each utterance's real (step, position) pairs of A'[u, s]·W[u, s]; small when the
    cross-attention runs along the diagonal, which is how text and speech align. ``cells``: the
    pairs to divide by (a whole batch's, :func:`tts_counts`; None: these rows').

    Shapes: weights (B, H, U, S) attention A'; text_lengths, step_lengths (B,) -> scalar.
    """
    w = guided_attention_weights(text_lengths, step_lengths, sigma=sigma, size=weights.shape[-2:])  # (B, U, S)
    pairs = (text_lengths * step_lengths).sum().clamp(min=1) if cells is None else max(cells, 1)
    return (weights.float() * w[:, None]).sum() / (pairs * weights.shape[1])


def tts_loss(
    model: nn.Module,
    text: Tensor,
    text_valid: Tensor,
    mel: Tensor,
    mel_valid: Tensor,
    speakers: Tensor | None = None,
    *,
    guided_weight: float = 1.0,
    guided_sigma: float = 0.2,
    guided_layers: int = 2,
    stop_weight: float = 5.0,
    whole: tuple[int, int] | None = None,
) -> tuple[Tensor, dict[str, float], int]:
    """A Transformer-TTS model's loss under teacher forcing, the parts as floats, and the real frames.

    Frames: L1 + L2 between the target and both the decoder's frames and the post-net's
    (Tacotron 2; ESPnet's Transformer-TTS), over real frames. Stop token: binary cross-entropy
    over real frames with target 1 at each utterance's last frame, that positive weighted
    ``stop_weight`` (one positive per utterance against hundreds of negatives). Alignment:
    :func:`guided_attention_loss` on every head of the last ``guided_layers`` decoder blocks,
    weighted ``guided_weight`` (0: off, and the fused attention path is kept).

    ``whole`` (:func:`tts_counts` of the whole batch, these rows one worker's share of it): every
    term is divided by the whole batch's count (frames; text × step pairs) instead of these rows',
    and the loss returned is this share's part of the whole batch's (:func:`share_loss`).

    Shapes: text (B, S), text_valid (B, S), mel (B, T, M) log-mels as the model reads them
    (``model.scale``), mel_valid (B, T), T a multiple of the model's reduction factor r,
    speakers (B,) or None -> scalar.
    """
    guided = guided_weight > 0
    text, text_valid, mel, mel_valid, speakers = on_model(model, text, text_valid, mel, mel_valid, speakers)
    before, after, stop, weights = model(text, text_valid, mel, mel_valid, speakers, need_weights=guided)
    keep = mel_valid[..., None].to(mel.dtype)  # (B, T, 1)
    real = keep.sum().clamp(min=1) if whole is None else max(whole[0], 1)  # the frames each term is a mean over
    n = real * mel.shape[-1]
    target = mel.float()
    frames = sum(
        ((out.float() - target).abs() * keep).sum() / n + ((out.float() - target) ** 2 * keep).sum() / n
        for out in (before, after)
    )
    lengths = mel_valid.sum(1)  # (B,)
    is_last = torch.arange(mel.shape[1], device=mel.device)[None, :] == (lengths[:, None] - 1)  # (B, T)
    stop_loss = F.binary_cross_entropy_with_logits(
        stop.float(),
        is_last.float(),
        weight=mel_valid.float(),
        pos_weight=torch.tensor(stop_weight, device=mel.device),
        reduction="sum",
    ) / (mel_valid.sum().clamp(min=1) if whole is None else real)
    loss = frames + stop_loss
    parts = {"frames": frames.item(), "stop": stop_loss.item()}
    if guided:
        r = model.config.reduction
        steps = (lengths + r - 1) // r  # (B,): decoder steps that read real frames
        texts = text_valid.sum(1)  # (B,)
        layers = weights[-guided_layers:]
        cells = whole[1] if whole is not None else None
        attention = sum(guided_attention_loss(w, texts, steps, sigma=guided_sigma, cells=cells) for w in layers)
        attention = attention / len(layers)
        loss = loss + guided_weight * attention
        parts["guided"] = attention.item()
    return loss, parts, int(mel_valid.sum())


def tts_counts(text_valid: Tensor, mel_valid: Tensor, *, reduction: int) -> tuple[int, int]:
    """The counts :func:`tts_loss`'s terms are means over: real frames, and the (decoder step,
    text position) pairs guided attention reads.

    Shapes: text_valid (B, S), mel_valid (B, T) -> two counts.
    """
    steps = (mel_valid.sum(1) + reduction - 1) // reduction  # (B,)
    return int(mel_valid.sum()), int((text_valid.sum(1) * steps).sum())


def seq2seq_batch(
    pairs: list[tuple[list[int], list[int]]], *, pad_id: int, bos_id: int, eos_id: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Pad (source ids, target ids) pairs into training tensors.

    Shapes:
        returns src (B, S), the decoder input [BEGIN] + target (B, T) and the expected
        output target + [END] (B, T), all padded with ``pad_id``.
    """
    s = max(len(src) for src, _ in pairs)
    t = max(len(tgt) for _, tgt in pairs) + 1
    src = torch.full((len(pairs), s), pad_id, dtype=torch.long)
    tgt_in = torch.full((len(pairs), t), pad_id, dtype=torch.long)
    tgt_out = torch.full((len(pairs), t), pad_id, dtype=torch.long)
    for i, (a, b) in enumerate(pairs):
        src[i, : len(a)] = torch.tensor(a, dtype=torch.long)
        tgt_in[i, : len(b) + 1] = torch.tensor([bos_id, *b], dtype=torch.long)
        tgt_out[i, : len(b) + 1] = torch.tensor([*b, eos_id], dtype=torch.long)
    return src, tgt_in, tgt_out


IGNORE = -100  # the label of a position no loss is computed at (F.cross_entropy's ignore_index)


def mask_tokens(
    ids: Tensor,
    *,
    maskable: Tensor,
    mask_id: int,
    random_ids: Tensor,
    generator: torch.Generator,
    rate: float = 0.15,
) -> tuple[Tensor, Tensor]:
    """BERT's masked-LM corruption (Devlin et al., 2019, section 3.1 and appendix A.1).

    Every position where ``maskable`` is True (a real token, not padding or a special token)
    is selected independently with probability ``rate``; a selected token becomes
    ``mask_id`` with probability 0.8, a token drawn uniformly from ``random_ids`` (the
    ordinary tokens) with probability 0.1, and stays as it is with probability 0.1. The
    labels hold the original token at the selected positions and ``IGNORE`` everywhere
    else, so a loss with ``ignore_id=IGNORE`` counts the selected positions only.

    Shapes: ids (B, S), maskable (B, S) bool, random_ids (R,) -> inputs (B, S), labels (B, S).
    """
    selected = (torch.rand(ids.shape, generator=generator) < rate) & maskable  # (B, S)
    labels = torch.where(selected, ids, IGNORE)  # (B, S)
    action = torch.rand(ids.shape, generator=generator)  # (B, S): < 0.8 mask, < 0.9 random, else keep
    drawn = random_ids[torch.randint(len(random_ids), ids.shape, generator=generator)]  # (B, S)
    inputs = torch.where(selected & (action < 0.8), mask_id, ids)  # (B, S)
    inputs = torch.where(selected & (action >= 0.8) & (action < 0.9), drawn, inputs)  # (B, S)
    return inputs, labels
