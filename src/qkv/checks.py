"""Checks: the properties qkv's tests prove on tiny models, measured on any model (``qkv check``).

What is here: :class:`Row` (one property: what was measured, the tolerance, the verdict),
:class:`Probe` (the inputs the checks read: given texts or audio, else drawn from the model's
tokenizer or a generated signal, :func:`probe_of`), the model's passes the checks compare
(:func:`teacher_forced`, :func:`stepped`, :func:`encoded`), one small function per property,
each returning a Row, and a model directory's checks: :func:`checked` (loaded with its probe),
:func:`checks` (each check, not yet run, for a caller that reports progress; a check the model
raises in is a FAIL row, :func:`attempted`) and :func:`run_checks` (them all, in turn).
The properties, for every family (text and speech encoder-decoders, decoder-only, encoder-only,
text-to-speech):

  * the explicit attention path equals the fused one (forward; gradients too with ``grad``);
  * causality: editing later target tokens (or frames) changes no earlier output (every decoder);
  * padding invariance: a padded batch gives each row its own encoder output (every encoder);
  * KV-cached decoding equals a full pass; a batch equals its inputs one by one; beam search
    of width 1 equals greedy (through ``qkv.decoding``'s public searches);
  * bfloat16 and int8 decoding drift from float32 (token agreement, log-probability
    difference): reported, never failed;
  * save -> load is bit-identical; export-hf -> import-hf computes the same outputs.

The test suite calls these same functions on tiny models (tests/test_check.py and the tests
that name them), so the checks and the tests are one implementation.

What is not here: printing the table (``cli/check.py``), the models, the searches, the
conversions (``checkpoint.py``, ``hf/``), the attention paths themselves (``attention.py``, whose
:func:`~qkv.attention.attention_path` forces one). The ONNX round trip is a hook
(:func:`onnx_round_trip`) until ``qkv export-onnx`` exists. Shapes use ``attention.py``'s legend.
"""

from __future__ import annotations

import copy
import math
import tempfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
from torch import Tensor, nn

from qkv.attention import MultiHeadAttention, attention_path
from qkv.audio import FeatureConfig, features, load_audio, pad_features
from qkv.checkpoint import kind_of, load_model, model_dir, read_meta, save_model
from qkv.data import read_lines
from qkv.decoding import beam_search, decoder_for, greedy, pad_rows
from qkv.errors import UserError
from qkv.hf.convert import export_hf, import_hf
from qkv.loading import DECODING_KINDS, prepared, reading_as_trained
from qkv.models.decoder_only import DecoderOnly
from qkv.models.encoder_decoder import EncoderDecoder
from qkv.models.encoder_only import EncoderOnly
from qkv.models.speech import SpeechEncoderDecoder
from qkv.models.tts import TransformerTTS
from qkv.onnx_export import EXPORTED_KINDS, export_onnx, read_source
from qkv.onnx_verify import TOLERANCE as ONNX_TOLERANCE
from qkv.onnx_verify import verify
from qkv.synthesis import synthesize
from qkv.tasks.tts import speaking_of, symbol_ids
from qkv.tokenization import FILE, Tokenizer, Vocabularies

FP32_TOLERANCE = 1e-4  # float32 paths that differ only in rounding: this times max(1, the outputs' largest |value|)
PASS, FAIL, INFO, SKIP = "PASS", "FAIL", "INFO", "SKIP"
MAX_NEW_TOKENS = 8  # the decoding checks' outputs: long enough to disagree, short enough to be quick
TARGET_TOKENS = 6  # teacher-forced target tokens per input (after BEGIN)
TTS_STEPS = 5  # teacher-forced decoder steps of a text-to-speech model
INPUTS_READ = 8  # lines of a given text file the checks read: properties, not throughput
SPEECH_SECONDS = (1.3, 0.7, 1.0)  # the generated signals (seconds): different lengths, so a batch pads


@dataclass(frozen=True)
class Row:
    """One property of one model.

    Attributes:
        name: the property.
        measured: the largest absolute difference found (or, for token checks, the number of
            outputs that differ); None where nothing was measured (SKIP).
        tolerance: the most ``measured`` may be to pass; None where the row is reported, not judged.
        status: PASS, FAIL, INFO (reported, never failed) or SKIP (does not apply; ``detail`` says why).
        detail: what was compared, or why the row does not apply.
    """

    name: str
    measured: float | None
    tolerance: float | None
    status: str
    detail: str = ""

    def as_dict(self) -> dict:
        """The row as JSON holds it: a measurement that is not finite (outputs of other shapes)
        is None, and ``detail`` says why."""
        out = asdict(self)
        if self.measured is not None and not math.isfinite(self.measured):
            out["measured"] = None
        return out


def judged(name: str, measured: float, tolerance: float, detail: str = "") -> Row:
    """A PASS or FAIL row: ``measured`` within ``tolerance`` (NaN fails)."""
    return Row(name, measured, tolerance, PASS if measured <= tolerance else FAIL, detail)


def skipped(name: str, why: str) -> Row:
    return Row(name, None, None, SKIP, why)


@dataclass(frozen=True)
class Probe:
    """What the checks feed a model.

    Attributes:
        sources: what the encoder (or a decoder-only model) reads: token id lists, or (T, M)
            feature tensors for a speech model; of different lengths, so a batch pads.
        targets: teacher-forced decoder inputs after BEGIN: TARGET_TOKENS token ids per source
            (a text-to-speech model: (U, M) frames, one per decoder step); empty for encoder-only.
    """

    sources: list
    targets: list


def fp32_tolerance(*outputs: Tensor) -> float:
    """FP32_TOLERANCE scaled by the outputs' largest magnitude (logits of 30 round as 1e-5 ones do not)."""
    finite = [o.detach()[torch.isfinite(o.detach())] for o in outputs]  # a NaN must not widen the tolerance
    scale = max((float(f.abs().max()) for f in finite if f.numel()), default=1.0)
    return FP32_TOLERANCE * max(1.0, scale)


def max_difference(a: Sequence[Tensor], b: Sequence[Tensor]) -> float:
    """The largest |a - b| over pairs of tensors of one shape: inf where shapes differ or either
    holds a NaN (equal values, infinities included, differ by 0)."""
    worst = 0.0
    for x, y in zip(a, b, strict=True):
        if x.shape != y.shape:
            return math.inf
        x, y = x.float(), y.float()
        gap = torch.where(x == y, 0.0, (x - y).abs()).nan_to_num(nan=math.inf)  # NaN never equals
        if gap.numel():
            worst = max(worst, float(gap.max()))
    return worst


# ----------------------------------------------------------------------------------- inputs


def ordinary_ids(tokenizer: Tokenizer | None, vocab_size: int, specials: Sequence[int | None]) -> list[int]:
    """The ids a drawn input may hold: the tokenizer's ordinary tokens (a special one decodes to
    nothing), or, without a tokenizer, every id but the model's special ones."""
    if tokenizer is None:
        ids = [i for i in range(vocab_size) if i not in set(specials)]
    else:
        texts = tokenizer.token_texts()
        ids = [i for i in range(min(vocab_size, len(texts))) if texts[i].strip() and i not in set(specials)]
    if not ids:
        raise UserError("the model's vocabulary has no ordinary token to draw inputs from")
    return ids


def drawn(ids: list[int], lengths: Sequence[int], generator: torch.Generator) -> list[list[int]]:
    """Token id lists of ``lengths``, each id drawn uniformly from ``ids``."""
    pool = torch.tensor(ids)
    return [pool[torch.randint(len(ids), (n,), generator=generator)].tolist() for n in lengths]


def signal(seconds: float, rate: int) -> Tensor:
    """A generated test signal: a rising chirp (200 Hz to 2 kHz) over a little noise. Shapes: (Y,)."""
    t = torch.arange(int(seconds * rate)) / rate  # (Y,)
    sweep = 200.0 * t + 900.0 * t**2 / max(seconds, 1e-3)  # phase / 2π of a linear chirp
    g = torch.Generator().manual_seed(int(seconds * 1000))
    return 0.3 * torch.sin(2 * math.pi * sweep) + 0.01 * torch.randn(t.shape, generator=g)


def speech_sources(config: FeatureConfig, audio: Path | None) -> list[Tensor]:
    """Feature sequences of different lengths: the given audio file whole and cut to 70% and
    40% of its frames, or generated signals. Whisper's features are always 30 s long, so the
    later rows are cut to shorter frame counts (the model reads any length, padding masked)."""
    if audio is not None:
        whole = features(load_audio(audio, sample_rate=config.sample_rate), config)  # (T, M)
        return [whole, whole[: max(8, int(len(whole) * 0.7))], whole[: max(8, int(len(whole) * 0.4))]]
    rows = [features(signal(s, config.sample_rate), config) for s in SPEECH_SECONDS]  # (T, M) each
    if config.kind == "whisper":
        rows = [f[: int(len(f) * s / max(SPEECH_SECONDS))] for f, s in zip(rows, SPEECH_SECONDS, strict=True)]
    return rows


def read_given(model: nn.Module, meta: dict, vocab: Vocabularies, texts: Sequence[str]) -> list[list[int]]:
    """The given ``texts`` as the model's own job reads them: a text-to-speech model's symbols
    as ``qkv speak`` reads them (normalized, then its recipe's characters or espeak-ng phonemes:
    its tokenizer never saw English spelling), a translation model's sources as it learnt them
    (a cascade's, as a recognizer writes them), else the tokenizer's ids; an empty one left out."""
    if isinstance(model, TransformerTTS):
        how = speaking_of(meta)
        return symbol_ids(vocab.source, texts, symbols=how["symbols"], voice=how["voice"])
    source = reading_as_trained(vocab, meta.get("recipe")).source
    return [ids for ids in (source.encode(t) for t in texts) if ids]


def probe_of(
    model: nn.Module,
    vocab: Vocabularies | None,
    *,
    given: Sequence[list[int]] = (),
    audio: Path | None = None,
    seed: int = 0,
) -> Probe:
    """The inputs the checks read: ``given`` (token id lists, :func:`read_given`) or ``audio``
    where given, else drawn from the model's tokenizer (or its vocabulary) and generated
    signals; targets drawn."""
    g = torch.Generator().manual_seed(seed)
    c = model.config
    source_tok = vocab.source if vocab is not None else None
    target_tok = vocab.target if vocab is not None else None
    specials = [getattr(c, n, None) for n in ("pad_id", "bos_id", "eos_id")]
    room = c.max_len - (TARGET_TOKENS + 1 if isinstance(model, DecoderOnly) else 0)  # a prompt leaves room for targets
    if isinstance(model, SpeechEncoderDecoder):
        sources = speech_sources(c.features, audio)
    elif given:
        sources = [ids[:room] for ids in given]
    else:
        v = getattr(c, "src_vocab_size", None) or c.vocab_size
        sources = drawn(ordinary_ids(source_tok, v, specials), [min(n, room) for n in (9, 5, 7)], g)
    if isinstance(model, EncoderOnly):
        return Probe(sources, [])
    if isinstance(model, TransformerTTS):
        frames = torch.randn(len(sources), TTS_STEPS, c.features.n_mels, generator=g)  # scaled frames
        return Probe(sources, list(frames))
    v = getattr(c, "tgt_vocab_size", None) or c.vocab_size
    return Probe(sources, drawn(ordinary_ids(target_tok, v, specials), [TARGET_TOKENS] * len(sources), g))


# --------------------------------------------------------------------- the models' passes


def encoded(model: nn.Module, sources: list) -> tuple[list[Tensor], Tensor, Tensor]:
    """Each source's encoder output as one padded batch gives it (its real positions), with the
    batch's memory and valid mask. Padding holds garbage, not the pad id: only the mask may hide it.
    Shapes: returns B tensors (S_b, D), memory (B, S, D), valid (B, S)."""
    if isinstance(model, SpeechEncoderDecoder):
        feats, valid = pad_features([f.to(_device(model)) for f in sources])  # (B, T, M), (B, T)
        memory, memory_valid = model.encode(feats.masked_fill(~valid[..., None], 7.0), valid)  # (B, S, D)
        return [m[v] for m, v in zip(memory, memory_valid, strict=True)], memory, memory_valid
    tokens, valid = pad_rows(sources, 0, device=_device(model))  # (B, S)
    tokens = tokens.masked_fill(~valid, _garbage(model))
    if isinstance(model, EncoderDecoder):
        memory = model.encode(tokens, src_mask=valid)  # (B, S, D)
    elif isinstance(model, EncoderOnly):
        memory = model.encode(tokens, mask=valid)  # (B, S, D)
    else:
        memory = model.encode(tokens, valid, _speakers(model, len(sources)))  # (B, S, D)
    return [m[v] for m, v in zip(memory, valid, strict=True)], memory, valid


def teacher_forced(model: nn.Module, probe: Probe) -> list[Tensor]:
    """Every input's outputs from one padded batch, teacher-forced: a decoder's logits at
    BEGIN and each target token (a decoder-only model: at each source token, then each target
    token), a text-to-speech model's frames and stop logits, an encoder's output.
    Shapes: B tensors (positions, V), (U·r, M + 1) or (S_b, D)."""
    if isinstance(model, EncoderOnly):
        return encoded(model, probe.sources)[0]
    if isinstance(model, DecoderOnly):
        rows = [s + t for s, t in zip(probe.sources, probe.targets, strict=True)]
        tokens, _ = pad_rows(rows, 0, device=_device(model))  # (B, L): right padding, which causality hides
        logits = model(tokens)  # (B, L, V)
        return [x[: len(r)] for x, r in zip(logits, rows, strict=True)]
    _, memory, valid = encoded(model, probe.sources)
    if isinstance(model, TransformerTTS):
        frames = torch.stack(probe.targets).to(_device(model))  # (B, U, M)
        out = model.decode(frames, memory, memory_valid=valid, prenet_dropout=False)
        return list(torch.cat([out.mel, out.stop[..., None]], dim=-1))  # (U·r, M + 1) each
    tgt = torch.tensor([[model.config.bos_id, *t] for t in probe.targets], device=_device(model))  # (B, L)
    return list(model.decode(tgt, memory, src_mask=valid).logits)  # (L, V) each


def stepped(model: nn.Module, probe: Probe) -> list[Tensor]:
    """The same logits as :func:`teacher_forced` at BEGIN and each target token, but through the
    decoding protocol (``decoding.Decoder``: start, then one cached step per target token) on
    the padded batch (a text-to-speech model: its decoder, one cached step at a time).
    Shapes: B tensors (targets + 1, V), or (U·r, M + 1)."""
    if isinstance(model, TransformerTTS):
        return _tts_stepped(model, probe)
    decoder = decoder_for(model)
    with torch.no_grad():
        logits, state = decoder.start(probe.sources)  # (B, V)
        steps = [logits]
        for i in range(len(probe.targets[0])):
            tokens = torch.tensor([t[i] for t in probe.targets], device=logits.device)  # (B,)
            logits, state = decoder.step(state, tokens)
            steps.append(logits)
    return list(torch.stack(steps, dim=1))  # (L, V) each


def _tts_stepped(model: TransformerTTS, probe: Probe) -> list[Tensor]:
    _, memory, valid = encoded(model, probe.sources)
    frames = torch.stack(probe.targets).to(memory.device)  # (B, U, M)
    cache, outputs = None, []
    for step in range(frames.shape[1]):
        out = model.decode(frames[:, step : step + 1], memory, memory_valid=valid, cache=cache, prenet_dropout=False)
        cache = out.cache
        outputs.append(torch.cat([out.mel, out.stop[..., None]], dim=-1))  # (B, r, M + 1)
    return list(torch.cat(outputs, dim=1))  # (U·r, M + 1) each


def _device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


def _garbage(model: nn.Module) -> int:
    """A token id for padded positions that is not the pad id (the mask alone must hide it)."""
    return 3 % (getattr(model.config, "src_vocab_size", None) or model.config.vocab_size)


def _speakers(model: nn.Module, n: int) -> Tensor | None:
    return None if getattr(model, "speaker", None) is None else torch.zeros(n, dtype=torch.long, device=_device(model))


def _is_decoder(model: nn.Module) -> bool:
    return not isinstance(model, EncoderOnly)


def _truncated(probe: Probe, t: int) -> Probe:
    """``probe`` with every target cut to its first ``t`` tokens (or frames)."""
    return Probe(probe.sources, [x[:t] for x in probe.targets])


# ------------------------------------------------------------------------------ the checks


def explicit_equals_fused(model: nn.Module, probe: Probe, *, grad: bool = False) -> Row:
    """The whole model on the explicit (textbook) attention path and on the fused kernel: the
    same outputs, and with ``grad`` the same gradients of every weight (of a fixed random
    weighting of the outputs). Sigmoid attention has no fused path."""
    name = "explicit == fused attention" + (" (+ gradients)" if grad else "")
    mhas = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    if all(m.normalization != "softmax" for m in mhas):
        return skipped(name, "sigmoid attention has the explicit path only")
    runs = [_outputs_and_grads(model, probe, path, grad) for path in ("explicit", "fused")]
    (out_e, grads_e), (out_f, grads_f) = runs
    measured = max_difference(out_e, out_f)
    tolerance = fp32_tolerance(*out_e)
    detail = "outputs"
    if grad:
        measured = max(measured, max_difference(grads_e, grads_f))
        tolerance = max(tolerance, fp32_tolerance(*grads_e))
        detail = f"outputs and the gradients of {len(grads_e)} weights"
    return judged(name, measured, tolerance, detail)


def _outputs_and_grads(model: nn.Module, probe: Probe, path: str, grad: bool) -> tuple[list[Tensor], list[Tensor]]:
    params = [p for p in model.parameters() if p.requires_grad]
    with attention_path(model, path), torch.set_grad_enabled(grad):
        outputs = teacher_forced(model, probe)
        if not grad:
            return outputs, []
        g = torch.Generator().manual_seed(1)
        loss = sum((o * torch.randn(o.shape, generator=g).to(o)).sum() for o in outputs)
        grads = torch.autograd.grad(loss, params, allow_unused=True)
    return [o.detach() for o in outputs], [x for x in grads if x is not None]


@torch.no_grad()
def causality(model: nn.Module, probe: Probe, *, cut: int | None = None) -> Row:
    """Every decoder: the targets edited from target ``cut`` on (None: the middle; tokens
    changed to others, frames shifted) leave the outputs before it as they were."""
    name = "causality"
    if not _is_decoder(model):
        return skipped(name, "an encoder-only model has no decoder")
    before = teacher_forced(model, probe)
    cut = len(probe.targets[0]) // 2 if cut is None else cut
    if isinstance(model, TransformerTTS):
        edited = [torch.cat([f[:cut], f[cut:] + 1.0]) for f in probe.targets]
        kept = cut * model.config.reduction  # frames written before the edited steps read anything
    else:
        ids = sorted({t for row in probe.targets for t in row})
        v = getattr(model.config, "tgt_vocab_size", None) or model.config.vocab_size
        shift = {t: ids[(i + 1) % len(ids)] for i, t in enumerate(ids)} if len(ids) > 1 else {ids[0]: (ids[0] + 1) % v}
        edited = [row[:cut] + [shift[t] for t in row[cut:]] for row in probe.targets]
        # logits at BEGIN and the first ``cut`` targets (a decoder-only model: the source too) see no edit
        kept = cut + 1
    after = teacher_forced(model, Probe(probe.sources, edited))
    firsts = [kept + (len(s) - 1 if isinstance(model, DecoderOnly) else 0) for s in probe.sources]
    measured = max_difference(
        [b[:k] for b, k in zip(before, firsts, strict=True)], [a[:k] for a, k in zip(after, firsts, strict=True)]
    )
    return judged(name, measured, fp32_tolerance(*before), f"targets edited from position {cut} on")


@torch.no_grad()
def padding_invariance(model: nn.Module, probe: Probe) -> Row:
    """Every encoder: each input's output in a padded batch (padding holding garbage) equals its
    output alone."""
    name = "padding invariance"
    if isinstance(model, DecoderOnly):
        return skipped(name, "no encoder (a left-padded batch of prompts: batched == one by one)")
    together, _, _ = encoded(model, probe.sources)
    alone = [encoded(model, [s])[0][0] for s in probe.sources]
    lengths = ", ".join(str(n) for n in sorted({len(s) for s in probe.sources}))
    unit = "frames" if isinstance(model, SpeechEncoderDecoder) else "tokens"
    detail = f"encoder outputs of inputs of {lengths} {unit}"
    return judged(name, max_difference(together, alone), fp32_tolerance(*alone), detail)


@torch.no_grad()
def cached_equals_full(model: nn.Module, probe: Probe) -> Row:
    """Decoding one token at a time over the KV cache (the decoding protocol, the padded batch)
    gives the logits of each input's full teacher-forced pass alone."""
    name = "KV cache == full pass"
    if not _is_decoder(model):
        return skipped(name, "an encoder-only model does not decode")
    pairs = zip(probe.sources, probe.targets, strict=True)
    full = [teacher_forced(model, Probe([s], [t]))[0] for s, t in pairs]
    if isinstance(model, DecoderOnly):  # the full pass's logits from the last source token on
        full = [f[len(s) - 1 :] for f, s in zip(full, probe.sources, strict=True)]
    cached = stepped(model, probe)
    detail = f"{len(probe.targets[0])} cached steps of a padded batch against each input's full pass"
    return judged(name, max_difference(cached, full), fp32_tolerance(*full), detail)


@torch.no_grad()
def batched_equals_alone(model: nn.Module, probe: Probe, *, beam: int = 3) -> Row:
    """Greedy and beam search over the padded batch give each input the tokens (and, beam search,
    the score) that it gets alone. A text-to-speech model: synthesis, frames compared."""
    name = "batched == one by one"
    if not _is_decoder(model):
        return skipped(name, "an encoder-only model does not decode")
    if isinstance(model, TransformerTTS):
        together = [s.mel for s in _synthesized(model, probe.sources)]
        alone = [_synthesized(model, [s])[0].mel for s in probe.sources]
        return judged(name, max_difference(together, alone), fp32_tolerance(*alone), "synthesized frames")
    n = MAX_NEW_TOKENS
    together = greedy(model, probe.sources, max_new_tokens=n)
    alone = [greedy(model, [s], max_new_tokens=n)[0] for s in probe.sources]
    beams = [h[0] for h in beam_search(model, probe.sources, beam_size=beam, max_new_tokens=n)]
    beams_alone = [beam_search(model, [s], beam_size=beam, max_new_tokens=n)[0][0] for s in probe.sources]
    differing = sum(a != b for a, b in zip(together, alone, strict=True))
    differing += sum(a.tokens != b.tokens for a, b in zip(beams, beams_alone, strict=True))
    if differing:
        return Row(name, float(differing), 0.0, FAIL, f"{differing} output(s) differ (greedy and beam {beam})")
    measured = max(abs(a.score - b.score) for a, b in zip(beams, beams_alone, strict=True))
    return judged(name, measured, FP32_TOLERANCE, f"greedy and beam {beam}: same tokens; beam scores differ by this")


def _synthesized(model: TransformerTTS, texts: list) -> list:
    return synthesize(
        model,
        texts,
        speakers=[0] * len(texts) if model.speaker is not None else None,
        max_frames=TTS_STEPS * model.config.reduction,
        prenet_dropout=False,
    )


@torch.no_grad()
def beam_one_equals_greedy(model: nn.Module, probe: Probe) -> Row:
    """Beam search of width 1 picks the greedy tokens (measured: outputs that differ)."""
    name = "beam width 1 == greedy"
    if isinstance(model, (EncoderOnly, TransformerTTS)):
        return skipped(name, "the model writes no tokens")
    g = greedy(model, probe.sources, max_new_tokens=MAX_NEW_TOKENS)
    b = [h[0].tokens for h in beam_search(model, probe.sources, beam_size=1, max_new_tokens=MAX_NEW_TOKENS)]
    differing = sum(x != y for x, y in zip(g, b, strict=True))
    return Row(
        name,
        float(differing),
        0.0,
        PASS if differing == 0 else FAIL,
        f"{len(g)} outputs of up to {MAX_NEW_TOKENS} tokens",
    )


@torch.no_grad()
def precision_drift(model: nn.Module, probe: Probe, precision: str) -> Row:
    """How far decoding in ``precision`` ("bf16" or "int8", the model as ``--bf16`` / ``--int8``
    prepare it) drifts from float32: the share of greedy output tokens that agree, and the
    largest difference of a teacher-forced token log-probability. Reported, never failed."""
    name = f"{precision} drift from fp32"
    kind = kind_of(model)
    if kind not in DECODING_KINDS:
        return skipped(name, "the model decodes no tokens")
    if precision == "int8" and _device(model).type != "cpu":
        return skipped(name, "int8 runs on the CPU only")
    other = prepared(
        copy.deepcopy(model), kind, bf16=precision == "bf16", int8=precision == "int8", device=_device(model)
    )
    ours = greedy(model, probe.sources, max_new_tokens=MAX_NEW_TOKENS)
    theirs = greedy(other, probe.sources, max_new_tokens=MAX_NEW_TOKENS)
    same = sum(a == b for x, y in zip(ours, theirs, strict=True) for a, b in zip(x, y, strict=False))
    total = sum(max(len(x), len(y)) for x, y in zip(ours, theirs, strict=True)) or 1
    logp = [torch.log_softmax(x.float(), -1) for x in stepped(model, probe)]
    logp_other = [torch.log_softmax(x.float(), -1) for x in stepped(other, probe)]
    chosen = [torch.tensor(t, device=x.device)[:, None] for t, x in zip(probe.targets, logp, strict=True)]
    measured = max_difference(
        [x[:-1].gather(1, c) for x, c in zip(logp, chosen, strict=True)],
        [x[:-1].gather(1, c) for x, c in zip(logp_other, chosen, strict=True)],
    )
    return Row(
        name, measured, None, INFO, f"token agreement {100 * same / total:.1f}%; measured: max |log p difference|"
    )


@torch.no_grad()
def save_load_round_trip(model: nn.Module, probe: Probe) -> Row:
    """save_model then load_model gives back every weight bit for bit, and the same outputs."""
    with tempfile.TemporaryDirectory(prefix="qkv-check-") as tmp:
        save_model(model, Path(tmp) / "model")
        loaded, _ = load_model(Path(tmp) / "model")
    return bit_identical(model, loaded.to(_device(model)), probe)


@torch.no_grad()
def bit_identical(model: nn.Module, loaded: nn.Module, probe: Probe) -> Row:
    """``loaded`` holds every weight of ``model`` (same names) bit for bit and computes the same
    outputs bit for bit (measured: the largest difference of a weight or an output)."""
    name = "save -> load bit-identical"
    ours, theirs = model.state_dict(), loaded.state_dict()
    if ours.keys() != theirs.keys():
        return Row(name, math.inf, 0.0, FAIL, "the loaded model's weights have other names")
    weights = max_difference(list(ours.values()), list(theirs.values()))
    unequal = sum(not torch.equal(ours[k], theirs[k]) for k in ours)
    outputs = max_difference(teacher_forced(model, probe), teacher_forced(loaded, probe))
    detail = f"{len(ours)} tensors ({unequal} not bit-identical) and the outputs"
    return Row(name, max(weights, outputs), 0.0, PASS if unequal == 0 and outputs == 0 else FAIL, detail)


@torch.no_grad()
def hf_round_trip(directory: Path, model: nn.Module, probe: Probe) -> Row:
    """export-hf then import-hf gives a model with the same outputs (where the family exports;
    what the Hugging Face architecture cannot express is skipped, saying why)."""
    name = "export-hf -> import-hf"
    if isinstance(model, TransformerTTS):
        return skipped(name, "no Hugging Face architecture is qkv's Transformer-TTS")
    with tempfile.TemporaryDirectory(prefix="qkv-check-") as tmp:
        try:
            summary = export_hf(directory, Path(tmp) / "hf")
        except UserError as e:
            return skipped(name, f"export refused: {e}")
        try:  # what export-hf wrote, import-hf refusing, is the round trip failing
            import_hf(Path(tmp) / "hf", Path(tmp) / "back")
            back, _ = load_model(Path(tmp) / "back")
        except UserError as e:
            return Row(name, None, None, FAIL, f"import-hf refused the export: {e}")
    back = back.to(_device(model))
    ours = teacher_forced(model, probe)
    measured = max_difference(ours, teacher_forced(back, probe))
    return judged(name, measured, fp32_tolerance(*ours), f"as {summary['architecture']}, outputs")


def onnx_round_trip(directory: Path, model: nn.Module, probe: Probe, *, onnx: bool = False) -> Row:
    """``qkv export-onnx --verify`` of ``directory`` into a temporary folder: each graph's largest
    difference from PyTorch on real inputs (:func:`~qkv.onnx_verify.verify`), within its
    tolerance, and a greedy decode driven through onnxruntime equal to qkv's. Only with ``onnx``
    (``qkv check --onnx``): each graph's export takes seconds."""
    name = "export-onnx -> onnxruntime"
    if not onnx:
        return skipped(name, "add --onnx to export the model and run it in onnxruntime (seconds per graph)")
    if read_meta(directory)["kind"] not in EXPORTED_KINDS:
        return skipped(name, f"ONNX export takes {', '.join(EXPORTED_KINDS)} models")
    source = read_source(directory)
    with tempfile.TemporaryDirectory() as tmp:
        export_onnx(source, Path(tmp) / "onnx")
        report = verify(source, Path(tmp) / "onnx")
    measured = max(g["relative_diff"] for g in report["graphs"].values())  # |difference| / max(1, |output|)
    decoded = report.get("greedy") or report.get("synthesis")  # tokens, or a TTS model's frames and stops
    said = "" if decoded is None else f"; {'greedy' if 'greedy' in report else 'synthesis'} equal: {decoded['equal']}"
    detail = f"{len(report['graphs'])} graph(s), |difference| / max(1, |output|)" + said
    if decoded is not None and not decoded["equal"]:
        return Row(name, measured, ONNX_TOLERANCE, FAIL, detail)
    return judged(name, measured, ONNX_TOLERANCE, detail)


# ------------------------------------------------------------------------------- all of them


@dataclass(frozen=True)
class Checked:
    """A model directory loaded for checking: the float32 model as saved, and what it reads."""

    directory: Path
    model: nn.Module
    probe: Probe


def checked(path: str | Path, *, given: str | Path | None = None, device: str = "cpu") -> Checked:
    """The model directory (or training run) ``path`` loaded for checking, with its probe: read
    from the file ``given`` (a speech model's: an audio file; the others': a text file, its
    first INPUTS_READ non-empty lines) or drawn from its tokenizer (its vocabulary, without one)
    and generated signals."""
    directory = model_dir(path)
    meta = read_meta(directory)
    model, meta = load_model(directory, meta=meta)
    model = model.to(device)
    files = meta.get("files", {})
    vocab = Vocabularies.load(directory, files=files) if FILE in files else None
    audio, ids = None, []
    if given is not None and meta["kind"] == "speech_encoder_decoder":
        audio = Path(given)
    elif given is not None:
        texts = [t for t in read_lines(given) if t.strip()][:INPUTS_READ]
        if not texts:
            raise UserError(f"{given} holds no text to check the model on")
        if vocab is None:
            raise UserError(f"{directory} has no {FILE}: reading text needs a model saved with its tokenizer")
        ids = read_given(model, meta, vocab, texts)
        if not ids:
            raise UserError("no line of the input holds a token the model's tokenizer knows")
    return Checked(directory, model, probe_of(model, vocab, given=ids, audio=audio))


def checks(target: Checked, *, grad: bool = False, onnx: bool = False) -> list[tuple[str, Callable[[], Row]]]:
    """Every check of ``target`` in the order the table shows them, each not yet run: (what it
    checks, the call), so a caller can report progress between them."""
    m, p, d = target.model, target.probe, target.directory
    return [
        ("attention paths", lambda: attempted("explicit == fused attention", explicit_equals_fused, m, p, grad=grad)),
        ("causality", lambda: attempted("causality", causality, m, p)),
        ("padding", lambda: attempted("padding invariance", padding_invariance, m, p)),
        ("KV cache", lambda: attempted("KV cache == full pass", cached_equals_full, m, p)),
        ("batching", lambda: attempted("batched == one by one", batched_equals_alone, m, p)),
        ("beam 1", lambda: attempted("beam width 1 == greedy", beam_one_equals_greedy, m, p)),
        ("bf16", lambda: attempted("bf16 drift from fp32", precision_drift, m, p, "bf16")),
        ("int8", lambda: attempted("int8 drift from fp32", precision_drift, m, p, "int8")),
        ("save/load", lambda: attempted("save -> load bit-identical", save_load_round_trip, m, p)),
        ("export-hf", lambda: attempted("export-hf -> import-hf", hf_round_trip, d, m, p)),
        ("ONNX", lambda: attempted("export-onnx -> onnxruntime", partial(onnx_round_trip, onnx=onnx), d, m, p)),
    ]


def attempted(name: str, check: Callable[..., Row], *args: object, grad: bool | None = None) -> Row:
    """``check(*args)``'s row, or a FAIL row named ``name`` saying what the model raised: a model
    that cannot even run a property's two ways fails it (a mask and a cache of other lengths,
    say), where a traceback would hide every other row."""
    try:
        return check(*args) if grad is None else check(*args, grad=grad)
    except (RuntimeError, ValueError, IndexError, TypeError, AssertionError) as e:
        message = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return Row(name, None, None, FAIL, f"raised {type(e).__name__}: {message}")


def run_checks(
    path: str | Path, *, given: str | Path | None = None, grad: bool = False, onnx: bool = False
) -> Iterator[Row]:
    """Every check of the model directory ``path``, one Row at a time (:func:`checked`, :func:`checks`)."""
    for _, check in checks(checked(path, given=given), grad=grad, onnx=onnx):
        yield check()


def failed(rows: Sequence[Row]) -> bool:
    return any(r.status == FAIL for r in rows)
