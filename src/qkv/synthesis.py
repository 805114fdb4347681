"""Speech synthesis: a text-to-speech model's decoder run autoregressively over its KV cache,
r frames a step, until its stop token or a cap, for a batch of sentences at once.

What is here: :class:`Synthesis` (one sentence's frames, whether the cap stopped it, its
alignment), :func:`synthesize` and :func:`check_speakers`. Each step feeds the last frame
written back to the decoder (through the pre-net, whose dropout stays on as the model was
trained to expect), and a sentence ends at the first frame whose stop probability passes
``stop_threshold``; the post-net then refines each sentence's frames on their own, so a
sentence synthesized in a batch is the one synthesized alone (for the same dropout draws).

What is not here: the model (``models/tts.py``), turning frames into sound (``vocoder.py``),
text normalisation and symbols (``tasks/tts.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from qkv.decoding import pad_rows
from qkv.models.tts import TransformerTTS


@dataclass(frozen=True)
class Synthesis:
    """One sentence: its refined log-mel frames (unscaled: what a vocoder inverts), whether it
    ran into the cap before its stop token, and the mean cross-attention of the last decoder
    block (alignment), if asked.

    Shapes: mel (T, M); alignment (U, S) or None, U = ⌈T / r⌉ steps, S text positions.
    """

    mel: Tensor
    hit_cap: bool
    alignment: Tensor | None


def check_speakers(speakers: list[int], *, texts: int, known: int) -> None:
    """ValueError unless ``speakers`` holds one index in [0, ``known``) per text: an index out of
    range would otherwise surface as torch's IndexError, which names neither it nor the range."""
    if len(speakers) != texts:
        raise ValueError(f"{len(speakers)} speakers for {texts} texts")
    for s in speakers:
        if not 0 <= s < known:
            raise ValueError(f"speaker {s} is not one of the model's {known} (0 to {known - 1})")


@torch.no_grad()
def synthesize(
    model: TransformerTTS,
    texts: list[list[int]],
    *,
    speakers: list[int] | None = None,
    max_frames: int = 1000,
    stop_threshold: float = 0.5,
    prenet_dropout: bool = True,
    alignments: bool = False,
    attention_window: tuple[int, int] | None = None,
) -> list[Synthesis]:
    """Synthesize the log-mel frames of every text (symbol ids, no padding) at once.

    ``max_frames`` caps each sentence (and the decoder's window, ``max_len`` steps of r frames,
    caps it too); a sentence still going there is returned with ``hit_cap``. The pre-net's
    dropout draws from torch's global generator: seed it (``torch.manual_seed``) for
    repeatable audio. ``prenet_dropout=False`` turns it off (for tests; the speech is worse).

    ``attention_window=(back, ahead)`` keeps each step's cross-attention (every block's) on the
    text positions from ``back`` before to ``ahead`` after the furthest peak so far, the mean of
    the blocks' heads (attention windowing at inference, Ping et al., 2018, "Deep Voice 3", §4):
    an alignment can then neither return to a word it has said, saying it twice, nor skip ahead.

    ``speakers``: one speaker index per text for a model with speaker embeddings
    (:func:`check_speakers`).

    Shapes: texts B lists of ids -> B :class:`Synthesis`.
    """
    if not texts:
        return []
    if any(not t for t in texts):
        raise ValueError("every text needs at least one symbol")
    c = model.config
    if speakers is not None and c.n_speakers:
        check_speakers(speakers, texts=len(texts), known=c.n_speakers)
    device = next(model.parameters()).device
    text, valid = pad_rows(texts, c.pad_id, left=False, device=device)  # (B, S)
    speaker_ids = torch.tensor(speakers, device=device) if speakers is not None else None  # (B,)
    memory = model.encode(text, valid, speaker_ids)  # (B, S, D)
    r, n_mels = c.reduction, c.features.n_mels
    steps = min(-(-max_frames // r), c.max_len)
    b = len(texts)
    frame = memory.new_zeros(b, 1, n_mels)  # (B, 1, M): the "go" frame
    cache = None
    written: list[Tensor] = []  # per step (B, r, M)
    attention: list[Tensor] = []  # per step (B, S)
    ends = torch.full((b,), -1, dtype=torch.long, device=device)  # (B,): frames of a finished sentence
    peak = torch.zeros(b, dtype=torch.long, device=device)  # (B,): the furthest attention peak so far
    where = torch.arange(text.shape[1], device=device)  # (S,)
    for step in range(steps):
        allowed = valid  # (B, S)
        if attention_window is not None:
            back, ahead = attention_window
            allowed = valid & (where >= (peak - back)[:, None]) & (where <= (peak + ahead)[:, None])  # (B, S)
        out = model.decode(
            frame,
            memory,
            memory_valid=allowed,
            cache=cache,
            need_weights=alignments or attention_window is not None,
            prenet_dropout=prenet_dropout,
        )
        cache = out.cache
        if attention_window is not None:
            mean = torch.stack([w[:, :, -1] for w in out.weights]).float().mean((0, 2))  # (B, S): blocks, heads
            peak = torch.maximum(peak, mean.argmax(-1))  # (B,)
        written.append(out.mel)  # (B, r, M)
        if alignments:
            attention.append(out.weights[-1][:, :, -1].mean(1))  # (B, S): the heads' mean
        stopping = torch.sigmoid(out.stop.float()) > stop_threshold  # (B, r)
        first = torch.where(stopping.any(1), stopping.int().argmax(1), -1)  # (B,)
        new = (ends < 0) & (first >= 0)  # (B,)
        ends = torch.where(new, step * r + first + 1, ends)  # (B,)
        if bool((ends >= 0).all()):
            break
        frame = out.mel[:, -1:]  # (B, 1, M): the last frame written is the next input
    mel = torch.cat(written, dim=1)  # (B, U·r, M)
    results = []
    for i in range(b):
        hit_cap = int(ends[i]) < 0
        n = mel.shape[1] if hit_cap else int(ends[i])
        refined = model.unscale(model.refine(mel[i : i + 1, :n])[0])  # (T_i, M)
        alignment = None
        if alignments:
            u = -(-n // r)
            alignment = torch.stack(attention[:u], dim=0)[:, i, : len(texts[i])]  # (U_i, S_i)
        results.append(Synthesis(refined, hit_cap, alignment))
    return results
