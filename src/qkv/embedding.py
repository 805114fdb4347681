"""Sentence embeddings from an encoder-only model, and how ``qkv embed`` chooses its settings.

What is here: :data:`POOLINGS` and :func:`pool` (a row of hidden states -> one vector:
the mean over the text's tokens, the first token's ([CLS]), the element-wise maximum, or the
sum over the square root of the length), :func:`sentence_embeddings`, :class:`EmbeddingSettings`
(what a model directory's ``config.json`` records under ``"embedding"``: ``qkv import-hf`` writes
there what a checkpoint's authors chose, from its sentence-transformers files and its maximum
length) and :func:`choose` (the settings a command uses: its own options, else what the model
records, else qkv's defaults, with a sentence that says which came from where).

The pooling modes compute what sentence-transformers' ``Pooling`` module computes on the same
hidden states: over the real tokens of a text ([BEGIN] text [END], never padding). qkv's
defaults, for a model that records nothing (one qkv trained): mean pooling, not normalized,
the model's whole window (``max_len``). A text longer than the window is cut at its end, as
Hugging Face tokenizers truncate (BEGIN and END are kept).

What is not here: the model (``models/encoder_only.py``), reading sentence-transformers files
(``hf/sentence_transformers.py``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from qkv.decoding import pad_rows
from qkv.errors import OptionError, UserError
from qkv.models.encoder_only import EncoderOnly, masked_mean
from qkv.tokenization import Tokenizer

FIELD = "embedding"  # the config.json field of a model directory that records the settings
POOLINGS = ("mean", "cls", "max", "mean_sqrt_len")  # sentence-transformers: mean_tokens, cls_token, ...
DEFAULT_POOLING = "mean"


def pool(h: Tensor, valid: Tensor, mode: str) -> Tensor:
    """One vector per row of hidden states, over its valid positions.

    Shapes: h (B, S, D), valid (B, S) bool -> (B, D). A row with no valid position gives zeros
    (mean, mean_sqrt_len) or -inf (max); callers leave such rows out.
    """
    if mode == "mean":
        return masked_mean(h, valid)  # (B, D)
    if mode == "mean_sqrt_len":
        total = (h * valid[..., None].to(h.dtype)).sum(1)  # (B, D)
        return total / valid.sum(1, keepdim=True).clamp(min=1).to(h.dtype).sqrt()  # (B, D)
    if mode == "max":
        return h.masked_fill(~valid[..., None], float("-inf")).max(1).values  # (B, D)
    if mode == "cls":
        return h[:, 0]  # (B, D): the BEGIN token ([CLS]); rows are padded on the right
    raise ValueError(f"unknown pooling {mode!r}; known: {', '.join(POOLINGS)}")


def frame(tokenizer: Tokenizer, texts: list[str], *, max_len: int) -> tuple[list[list[int]], int]:
    """[BEGIN] text [END] ids of each text, cut at the end of the text to fit ``max_len`` tokens
    in all; and how many texts were cut."""
    begin = [tokenizer.bos_id] if tokenizer.bos_id is not None else []
    end = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
    room = max_len - len(begin) - len(end)
    if room < 1:
        raise UserError(f"a window of {max_len} tokens leaves no room for text between BEGIN and END")
    rows, cut = [], 0
    for ids in tokenizer.encode_batch(texts):
        if len(ids) > room:
            ids, cut = ids[:room], cut + 1
        rows.append(begin + ids + end)
    return rows, cut


@torch.no_grad()
def sentence_embeddings(
    model: EncoderOnly,
    tokenizer: Tokenizer,
    texts: list[str],
    *,
    pooling: str = DEFAULT_POOLING,
    normalize: bool = False,
    max_len: int | None = None,
    batch_size: int = 64,
) -> tuple[Tensor, int]:
    """One vector per text, pooled (``pooling``, one of :data:`POOLINGS`) from the last hidden
    states of [BEGIN] text [END] cut to ``max_len`` tokens (default: the model's window); and
    how many texts were cut.

    An empty (or blank) text gives a zero row, so rows match texts one to one; ``normalize``
    scales every other row to unit L2 norm. Batches group texts of similar length; padding does
    not change a row (keys at padding get no attention weight, and no pooling reads it).

    Shapes: returns (N, D) float32.
    """
    if pooling not in POOLINGS:
        raise UserError(f"unknown pooling {pooling!r}; known: {', '.join(POOLINGS)}")
    window = model.config.max_len if max_len is None else max_len
    if window > model.config.max_len:
        raise UserError(f"a window of {window} tokens is longer than the model's {model.config.max_len} positions")
    model.eval()
    device = next(model.parameters()).device
    todo = [i for i, text in enumerate(texts) if text.strip()]
    rows, cut = frame(tokenizer, [texts[i] for i in todo], max_len=window)
    vectors = torch.zeros(len(texts), model.config.d_model)  # (N, D)
    order = sorted(range(len(todo)), key=lambda k: len(rows[k]))
    for start in range(0, len(order), batch_size):
        chunk = order[start : start + batch_size]
        x, valid = pad_rows([rows[k] for k in chunk], model.config.pad_id, device=device)  # (B, S), (B, S)
        h = model.encode(x, mask=valid)  # (B, S, D)
        vectors[[todo[k] for k in chunk]] = pool(h, valid, pooling).float().cpu()  # (B, D)
    if normalize:
        vectors = torch.nn.functional.normalize(vectors, dim=-1)  # zero rows stay zero
    return vectors, cut


@dataclass(frozen=True)
class EmbeddingSettings:
    """What a model directory records for embedding (each None where it records nothing):
    ``pooling`` (one of :data:`POOLINGS`), ``normalize``, ``max_len`` (the window, in tokens with
    BEGIN and END, at most the model's positions) and ``source`` (where they came from, in words)."""

    pooling: str | None = None
    normalize: bool | None = None
    max_len: int | None = None
    source: str | None = None

    def record(self) -> dict:
        """The settings as config.json's ``"embedding"`` field holds them (unset ones left out)."""
        fields = {"pooling": self.pooling, "normalize": self.normalize, "max_len": self.max_len, "source": self.source}
        return {k: v for k, v in fields.items() if v is not None}

    @classmethod
    def read(cls, meta: dict, path: Path | str, *, model_max_len: int) -> EmbeddingSettings:
        """The settings of a model directory's config.json (``meta``, read from ``path``); none
        recorded: all None. Errors name the file and the field."""
        found = meta.get(FIELD)
        if found is None:
            return cls()
        where = f"{path}: field {FIELD!r}"
        if not isinstance(found, dict):
            raise UserError(f"{where} must be a JSON object")
        unknown = sorted(set(found) - {"pooling", "normalize", "max_len", "source"})
        if unknown:
            raise UserError(f"{where} has unknown key(s) {', '.join(unknown)}")
        pooling, normalize = found.get("pooling"), found.get("normalize")
        max_len, source = found.get("max_len"), found.get("source")
        if pooling is not None and pooling not in POOLINGS:
            raise UserError(f"{where}: pooling must be one of {', '.join(POOLINGS)}, got {pooling!r}")
        if normalize is not None and not isinstance(normalize, bool):
            raise UserError(f"{where}: normalize must be true or false, got {normalize!r}")
        if max_len is not None and (
            isinstance(max_len, bool) or not isinstance(max_len, int) or not 1 <= max_len <= model_max_len
        ):
            raise UserError(f"{where}: max_len must be an integer in [1, {model_max_len}], got {max_len!r}")
        if source is not None and not isinstance(source, str):
            raise UserError(f"{where}: source must be a string, got {source!r}")
        return cls(pooling, normalize, max_len, source)


@dataclass(frozen=True)
class Choice:
    """The settings an embedding command uses, and ``said``: which came from where, in words."""

    pooling: str
    normalize: bool
    max_len: int
    said: str


def choose(
    recorded: EmbeddingSettings,
    *,
    model_max_len: int,
    pooling: str | None = None,
    normalize: bool | None = None,
    max_len: int | None = None,
) -> Choice:
    """Each setting from the command's option where it gives one (``pooling``, ``normalize``,
    ``max_len``: None for not given), else from the model directory (``recorded``), else qkv's
    default (mean pooling, not normalized, the model's whole window)."""
    if pooling is not None and pooling not in POOLINGS:
        raise UserError(f"unknown pooling {pooling!r}; known: {', '.join(POOLINGS)}")
    if max_len is not None and not 1 <= max_len <= model_max_len:
        raise OptionError(
            f"max_len {max_len}: the model has {model_max_len} positions; give 1 to {model_max_len}", "max_len"
        )
    origins: dict[str, list[str]] = {}
    values = []
    for name, option, flag, kept, default in (
        ("pooling", pooling, "--pooling", recorded.pooling, DEFAULT_POOLING),
        ("normalization", normalize, "--normalize" if normalize else "--no-normalize", recorded.normalize, False),
        ("window", max_len, "--max-len", recorded.max_len, model_max_len),
    ):
        if option is not None:
            value, origin = option, flag
        elif kept is not None:
            value, origin = kept, f"recorded in the model directory ({recorded.source or 'config.json'})"
        else:
            value, origin = default, "qkv's default"
        values.append(value)
        origins.setdefault(origin, []).append(name)
    chosen_pooling, chosen_normalize, chosen_max_len = values
    said = (
        f"{chosen_pooling} pooling, {'normalized' if chosen_normalize else 'not normalized'}, "
        f"window {chosen_max_len} tokens; "
        + "; ".join(f"{_listed(names)}: {origin}" for origin, names in origins.items())
    )
    return Choice(chosen_pooling, chosen_normalize, chosen_max_len, said)


def _listed(names: list[str]) -> str:
    """The names joined as prose: a; a and b; a, b and c."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
