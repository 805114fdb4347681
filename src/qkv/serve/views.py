"""What the page's speech, speech-out and chat views draw: spectrograms and the attention over them.

What is here, each a job the model thread runs (``routes/views.py`` gives them HTTP):
  * :func:`heard_view`: a decoded segment of a transcript (its token ids, as ``verbose_json``
    gives them) over its stretch of the audio: the log-mel the model reads there and every
    decoder layer's cross-attention, the rows the steps that wrote the segment's tokens, the
    columns the encoder positions that hold the stretch (an imported Whisper's padding of its
    30-second window left out). One teacher-forced pass with the attention recorded
    (``inspection.recording``, the capture the text page's maps come from); the stretch is read
    alone, so a Whisper segment decoded inside a longer window is read here without the rest.
  * :func:`spoken_view`: a text spoken as ``POST /v1/audio/speech`` speaks it (the same seed:
    the same audio): the log-mel frames of the speech and, for qkv's own Transformer-TTS, every
    decoder layer's cross-attention recorded while it spoke (rows: decoder steps, each r frames,
    ``steps`` giving their frames; columns: the text's symbols); an imported Piper voice (VITS)
    has no cross-attention: its alignment is the durations it gave each phoneme (``alignment``).
  * :func:`chat_view`: a chat answer's token over the conversation: the conversation as the
    model reads it (the chat template), the answer after it, and the attention of every layer and
    head from the step that wrote the token (``inspection.attention_maps``).

What is not here: HTTP and limits (``routes/views.py``), the page (``static/``), the text
page's maps (``attention.py``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from qkv.audio import FeatureConfig, features
from qkv.bundle import speeches
from qkv.inspection import attention_maps, recording
from qkv.piper import Voice, phoneme_ids, phonemize
from qkv.serve.audio import sentences
from qkv.serve.completions import chat_ask
from qkv.serve.models import Served
from qkv.tasks.asr import too_short
from qkv.tasks.tts import speaking_of, symbol_ids

MEL_BINS = 80  # the spectrogram of a Piper voice's speech (it reads no log-mel of its own)


class Unfit(ValueError):
    """A request the model cannot draw (a stretch too short, tokens it does not have): a 422."""


def rounded(x: Tensor, digits: int) -> list:
    """``x`` as nested lists of ``digits`` decimals (rounded in float64: no 0.1851000040769577)."""
    scale = 10.0**digits
    return ((x.double() * scale).round() / scale).tolist()


# ----------------------------------------------------------------------------- speech in


def heard_view(
    served: Served, waves: list[Tensor], *, start: float, end: float, tokens: list[int], language: str | None
) -> list[dict]:
    """The segment of ``tokens`` heard from ``start`` to ``end`` seconds of the one waveform of
    ``waves`` (see the module). Shapes: mel (T, M); cross [layer] (H, rows, S)."""
    (wave,) = waves
    bundle, model = served.bundle, served.model
    config, rate = bundle.features, bundle.sample_rate
    piece = wave[max(0, round(start * rate)) : round(end * rate)]  # (Y,)
    if config.kind == "whisper":  # a Whisper reads one window: a longer stretch is cut to it
        piece = piece[: round(config.chunk_seconds * rate)]
    if piece.numel() == 0 or too_short(model, config.frames(piece.numel())):
        raise Unfit(f"the stretch {start:g} to {end:g} s is too short for model {served.name} to read")
    text = spoken_tokens(served, tokens)
    first = start_tokens(served, language)
    if len(first) + len(text) - 1 > model.config.max_len:  # the last token written is never read
        raise Unfit(f"tokens: model {served.name} writes at most {model.config.max_len - len(first) + 1} in a segment")
    feats = features(piece, config)  # (T, M): a Whisper's padded to its window
    real = min(feats.shape[0], 1 + piece.numel() // config.hop_length)  # the frames that hold audio
    columns = int(model.subsampled(torch.tensor([real]))[0])
    rows = slice(len(first) - 1, len(first) - 1 + len(text))  # the steps that wrote the segment's tokens
    cross = [w[:, rows, :columns] for w in read_cross(model, feats, [*first, *text[:-1]])]  # (H, rows, S) per layer
    seconds = piece.numel() / rate
    return [
        {
            "start": start,
            "end": start + seconds,
            "tokens": served.token_strings(served.vocab.target, text),
            "mel": rounded(feats[:real].float(), 2),
            "frame_seconds": config.hop_length / rate,
            "column_seconds": seconds / max(columns, 1),
            "cross": [rounded(w, 4) for w in cross],
            "layers": len(cross),
            "heads": model.config.n_heads,
        }
    ]


def read_cross(model: torch.nn.Module, feats: Tensor, tokens: list[int]) -> list[Tensor]:
    """Every decoder layer's cross-attention while a speech model reads ``feats`` and the
    decoder reads ``tokens`` (teacher-forced, the explicit path: ``inspection.recording``).
    Shapes: feats (T, M) -> per layer (H, L, S)."""
    param = next(model.parameters())
    with torch.no_grad(), recording(model) as found:
        memory, valid = model.encode(feats[None].to(param.device, param.dtype))  # (1, S, D), (1, S)
        model.decode(torch.tensor([tokens], device=param.device), memory, src_mask=valid)  # (1, L, V)
    return [w[0].float() for w in found["cross"]]  # (H, L, S) per layer


def spoken_tokens(served: Served, tokens: list[int]) -> list[int]:
    """A segment's token ids without what is not its text: an imported Whisper's timestamps and
    special tokens (every id from its END on), a model of qkv's own BEGIN, END and padding."""
    config = served.model.config
    if any(not 0 <= t < config.vocab_size for t in tokens):
        raise Unfit(f"tokens: model {served.name}'s ids are 0 to {config.vocab_size - 1}")
    if served.bundle.whisper is not None:
        kept = [t for t in tokens if t < config.eos_id]
    else:
        kept = [t for t in tokens if t not in (config.bos_id, config.eos_id, config.pad_id)]
    if not kept:
        raise Unfit("tokens: the segment has no text tokens")
    return kept


def start_tokens(served: Served, language: str | None) -> list[int]:
    """What the decoder reads before a transcript: BEGIN (a model of qkv's own), an imported
    Whisper's start tokens for ``language`` (its transcribe task, no timestamps)."""
    bundle = served.bundle
    bos = bundle.model.config.bos_id
    if bundle.whisper is None:
        return [bos]
    if bundle.whisper.multilingual and language is None:
        raise Unfit(f"language: model {served.name} is multilingual; give the language its transcript names")
    where = bundle.path / "config.json"
    return list(bundle.whisper.prefix(bos, language=language, task="transcribe", timestamps=False, where=where))


# ----------------------------------------------------------------------------- speech out


def spoken_view(served: Served, texts: list[str], *, speaker: str | None, speed: float) -> list[dict]:
    """The one text of ``texts`` spoken, with its spectrogram and attention (see the module)."""
    (text,) = texts
    if served.kind == "vits":
        return [piper_view(served, text, speaker=speaker, speed=speed)]
    bundle, model = served.bundle, served.model
    parts = sentences(text)
    how = speaking_of(bundle.meta)
    ids = symbol_ids(bundle.vocab.source, parts, symbols=how["symbols"], voice=how["voice"])
    with recording(model) as found:
        said = speeches(bundle, parts, speaker=speaker, seed=0)  # as audio.speak: the same audio
    frames = [s.mel.shape[0] for s, _ in said]
    c = model.config
    mel = torch.cat([s.mel for s, _ in said])  # (T, M)
    rate = bundle.sample_rate
    view = {
        "tokens": [served.token_strings(bundle.vocab.source, one) for one in ids],
        "mel": rounded(mel.float(), 2),
        "frame_seconds": c.features.hop_length / rate,
        "seconds": sum(w.numel() for _, w in said) / rate,
        "steps": step_frames(frames, c.reduction),
        "cross": None,
        "alignment": None,
        "layers": c.n_decoder_layers,
        "heads": c.n_heads,
    }
    cross = tts_cross(found["cross"], ids, frames, c.reduction, c.n_decoder_layers)
    if cross is not None:
        view["cross"] = [rounded(w, 4) for w in cross]
    return [view]


def step_frames(frames: Sequence[int], reduction: int) -> list[list[int]]:
    """Each decoder step's frames [first, end) in the joined speech: sentence after sentence,
    a step writes ``reduction`` frames (the last of a sentence those it kept)."""
    spans, offset = [], 0
    for n in frames:
        spans += [[offset + a, offset + min(a + reduction, n)] for a in range(0, n, reduction)]
        offset += n
    return spans


def tts_cross(
    calls: list[Tensor], ids: list[list[int]], frames: list[int], reduction: int, layers: int
) -> list[Tensor] | None:
    """Every decoder layer's cross-attention of the sentences spoken in one batch, block by
    block (sentence after sentence), from the weights recorded call by call (each step calls
    every layer: (B, H, 1, S) each). The batch holds the sentences shortest first (a stable sort,
    as ``tasks.tts.speak`` orders them); None where they were not spoken in one batch.
    Shapes: -> per layer (H, U, S), U the steps of all sentences, S their symbols."""
    width = max(len(i) for i in ids)
    if not calls or len(calls) % layers or any(w.shape[0] != len(ids) or w.shape[-1] != width for w in calls):
        return None
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    steps = [math.ceil(n / reduction) for n in frames]
    out = []
    for layer in range(layers):
        w = torch.cat(calls[layer::layers], dim=2).float()  # (B, H, steps, S)
        block = w.new_zeros(w.shape[1], sum(steps), sum(map(len, ids)))  # (H, U, S)
        u = s = 0
        for i in range(len(ids)):
            row = order.index(i)
            block[:, u : u + steps[i], s : s + len(ids[i])] = w[row, :, : steps[i], : len(ids[i])]
            u, s = u + steps[i], s + len(ids[i])
        out.append(block)
    return out


def piper_view(served: Served, text: str, *, speaker: str | None, speed: float) -> dict:
    """An imported Piper voice's speech of ``text`` as ``bundle.piper_speeches`` makes it (seed 0,
    the noise drawn in the same order), its log-mel, and the durations it gave each phoneme as
    the alignment [phoneme][first frame, end frame)."""
    bundle, model = served.bundle, served.model
    voice = Voice.read(bundle.path)
    names = {i: p for p, ids in voice.id_map.items() for i in ids}
    generator = torch.Generator(device=bundle.device)
    generator.manual_seed(0)
    who = None if speaker is None else bundle.speakers.index(speaker)
    tokens, alignment, waves, offset = [], [], [], 0
    for sentence in phonemize(text, voice.espeak_voice):
        ids = phoneme_ids(sentence, voice.id_map)
        wave, ends = piper_sentence(served, ids, who, model.config.length_scale / speed, generator)
        waves.append(wave)
        tokens += [names.get(i, "?") for i in ids]
        alignment += [[offset + a, offset + b] for a, b in zip([0, *ends[:-1]], ends, strict=True)]
        offset += ends[-1] if ends else 0
    wave = torch.cat(waves).float().cpu() if waves else torch.zeros(0)  # (Y,)
    rate, hop = bundle.sample_rate, model.config.hop
    config = FeatureConfig(sample_rate=rate, n_mels=MEL_BINS, n_fft=4 * hop, win_length=4 * hop, hop_length=hop)
    mel = features(wave, config)[:offset] if wave.numel() else torch.zeros(0, MEL_BINS)  # (T, M)
    return {
        "tokens": [tokens],
        "mel": rounded(mel, 2),
        "frame_seconds": hop / rate,
        "seconds": wave.numel() / rate,
        "steps": None,
        "cross": None,
        "alignment": alignment,
        "layers": 0,
        "heads": 0,
    }


def piper_sentence(
    served: Served, ids: list[int], speaker: int | None, pace: float, generator: torch.Generator
) -> tuple[Tensor, list[int]]:
    """One sentence's phoneme ids spoken as ``piper.speak`` speaks it (scaled to peak 1), and
    where each phoneme's frames end. Shapes: -> (Y,), S ends."""
    device = served.bundle.device
    speech = served.model(
        torch.tensor([ids], device=device),  # (1, S)
        torch.tensor([len(ids)], device=device),
        speakers=None if speaker is None else torch.tensor([speaker], device=device),
        length_scale=pace,
        generator=generator,
    )
    wave = speech.waveform[0, : int(speech.lengths[0])]  # (Y,)
    peak = wave.abs().max() if wave.numel() else wave.new_zeros(())
    wave = (wave / peak if peak >= 1e-8 else torch.zeros_like(wave)).clamp(-1, 1)
    return wave, torch.cumsum(speech.durations[0], 0).long().tolist()


# ----------------------------------------------------------------------------- chat


def chat_view(served: Served, chats: list[tuple[list[Mapping[str, str]], str, int | None]]) -> list[dict]:
    """For the one (messages, answer, token) of ``chats``: the conversation's tokens as the
    model reads them, the answer's after them (from ``answer_start``), and the attention of
    the step that wrote answer token ``token`` (None: the last) over everything before it,
    every layer and head. Shapes: weights [layer] (H, row + 1)."""
    ((messages, answer, token),) = chats
    tokenizer = served.vocab.source
    said = tokenizer.encode(answer, add_special_tokens=False)
    if not said:
        raise Unfit("answer: there is no answer to read")
    prompt = list(chat_ask(served, messages, max_new_tokens=len(said) + 1, stops=()).prompt)
    token = len(said) - 1 if token is None else token
    if not 0 <= token < len(said):
        raise Unfit(f"token: the answer has {len(said)} tokens (0 to {len(said) - 1})")
    try:
        maps = attention_maps(served.model, prompt, said)
    except ValueError as e:  # more than the window holds
        raise Unfit(str(e)) from None
    row = len(prompt) - 1 + token  # the step that read what came before the token and wrote it
    weights = [w[:, row, : row + 1] for w in maps.decoder]  # (H, row + 1) per layer
    return [
        {
            "tokens": served.token_strings(tokenizer, [*prompt, *said]),
            "answer_start": len(prompt),
            "token": token,
            "row": row,
            "weights": [rounded(w, 4) for w in weights],
            "layers": len(weights),
            "heads": weights[0].shape[0],
        }
    ]
