"""Attention: the shape legend, masks, the attention maths and multi-head attention.

What is here:
  * the one shape legend used by every file of qkv (below);
  * boolean masks (``True`` = may attend): padding, causal and their combination;
  * attention as two interchangeable pure functions, the explicit textbook path
    (:func:`attention_explicit`, which can return the weights A') and the fused path
    through ``torch.nn.functional.scaled_dot_product_attention`` (:func:`attention_fused`),
    tested equal to each other, and :func:`attention_path`, which forces one of them on a
    whole model (``qkv check`` compares them on a user's model);
  * repeating grouped-query heads for the explicit path (:func:`repeat_kv_heads`);
  * :class:`MultiHeadAttention`, which owns Wq, Wk, Wv and Wo and serves self- and
    cross-attention; its forward reads as the textbook (project, attend, merge the heads)
    and leaves each of the steps above to its own function; ``fuse_qkv`` stacks Wq, Wk, Wv
    into one product for decoding, after which one call rotates the queries and keys together
    (RoPE's tables and rotation from ``positions.py``).

What is not here: position maths, RoPE and ALiBi (``positions.py``: attention applies them, but
they are maths of positions, not of attention); the KV cache and how it grows (``kv_cache.py``: a
``(k, v)`` tuple or a preallocated :class:`~qkv.kv_cache.KVBuffer`, which
:func:`~qkv.kv_cache.extend_cache` grows), feed-forward layers, embeddings, norms and dropout (``layers.py``, whose
:func:`~qkv.layers.dropout` the explicit path uses on A'), blocks (``blocks.py``), anything
about a particular model family.

Shape legend, the one for all of qkv: every ``# (...)`` shape comment and ``Shapes:`` section
uses these letters, each with one meaning in every file. A dimension too rare for a letter is
named by a word, e.g. ``(B, channels, T)``, ``(B, G, capacity, K)``, ``(B, classes)``. Letters
in an equation name tensors, not dimensions (Q, K, V, A, A', O below).
    B  batch                      S  source (key/value) positions
    T  target (query) positions   D  model width, d_model
    H  query heads                G  key/value heads (grouped-query; G divides H)
    K  head width, D // H unless  F  feed-forward width, d_ff
       a model sets it (Gemma)
    V  vocabulary size            N  rows picked or flattened: hypotheses (B·W), the
                                     positions ``only`` selects (only.sum()), texts, windows
  decoding and training:
    P  positions already cached (S = P + T)
    W  beam width                 C  candidate tokens scored per row
    L  tokens so far: a hypothesis, or a speech model's target (T counts its frames)
    R  token ids to draw from
  speech (audio.py, vocoder.py, models/speech.py, models/tts.py), where T and S count frames:
    Y  samples of a mono waveform (librosa's y)
    T  frames of a feature sequence (what a speech encoder reads, or a TTS model writes)
    S  frames after a speech front-end's subsampling (the positions the decoder attends to)
    M  mel bins, n_mels           E  STFT frequency bins, n_fft // 2 + 1
    U  text-to-speech decoder steps, one per group of r frames (U = T / r)
    Z  frames of a VITS latent, what a voice's HiFi-GAN generator reads (Y = Z · its hop)

The textbook writes A = KᵀQ and O = V·A' with one column per position; PyTorch keeps one
*row* per position, so the same products read A = Q·Kᵀ and O = A'·V here.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qkv import layers
from qkv.kv_cache import KVBuffer, KVCache, extend_cache
from qkv.positions import Rope, rope_apply_rolled, rope_turn

NORMALIZATIONS = ("softmax", "sigmoid")

# --------------------------------------------------------------------------- masks


def padding_mask(valid: Tensor) -> Tensor:
    """Key-padding mask from a per-token validity tensor.

    Shapes:
        valid: (B, S) bool, True for real tokens.
        returns: (B, 1, 1, S) bool, broadcastable over heads and queries.
    """
    return valid[:, None, None, :]  # (B, 1, 1, S)


def causal_mask(t: int, s: int, *, window: int | None = None, device: torch.device | None = None) -> Tensor:
    """Causal mask for ``t`` new queries placed at the end of ``s`` keys.

    Query i sits at absolute position ``s - t + i`` and may attend to keys 0..s-t+i.
    With ``t == s`` this is the usual lower triangle; with a KV cache (``t < s``) it is
    the bottom rows of it. A ``window`` (sliding-window attention: Beltagy et al., 2020,
    "Longformer", section 3.1; Mistral, Gemma) keeps only the newest ``window`` of those keys,
    the query's own included: key j with j > q - window.

    Shapes:
        returns: (T, S) bool.
    """
    q_pos = torch.arange(s - t, s, device=device)[:, None]  # (T, 1)
    k_pos = torch.arange(s, device=device)[None, :]  # (1, S)
    if window is None:
        return k_pos <= q_pos  # (T, S)
    return (k_pos <= q_pos) & (k_pos > q_pos - window)  # (T, S)


# -------------------------------------------------------------- attention maths


def attention_explicit(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    normalization: str = "softmax",
    dropout: float = 0.0,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Scaled dot-product attention, one textbook step per line.

    A = Q·Kᵀ / √K (Vaswani et al., 2017, eq. 1; ``scale`` replaces 1/√K where a model says
    so: Gemma's 1/√query_pre_attn_scalar), plus an optional additive bias (ALiBi);
    positions the mask forbids are removed; A' = normalize(A); O = A'·V.

    ``normalization="softmax"`` normalizes each query row to sum to one. ``"sigmoid"``
    applies an elementwise sigmoid to A + b with b = -log(n) (Ramapuram et al., 2024,
    "Theory, Analysis, and Best Practices for Sigmoid Self-Attention", section 3.2), where
    n is the number of keys the row may attend to: this equals the paper's sequence length
    when nothing is masked, and keeps padded batches and KV-cached decoding equal to
    unpadded, uncached runs.

    A query row with no key to attend to (a fully padded row) gets all-zero weights and a
    zero output, never NaN, forward or backward.

    ``dropout`` zeroes each weight of A' with that probability before O = A'·V (Vaswani et
    al., section 5.4, applied to the weights) through :func:`qkv.layers.dropout`; the
    returned A' is undropped. Pass 0 at evaluation.

    Shapes:
        q: (B, H, T, K); k, v: (B, H, S, K).
        mask: bool, broadcastable to (B, H, T, S); True = may attend.
        bias: float, broadcastable to (B, H, T, S).
        returns: output (B, H, T, K) and weights A' (B, H, T, S).
    """
    if normalization not in NORMALIZATIONS:
        raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {normalization!r}")
    if scale is None:
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])  # (B, H, T, S)
    else:
        scores = q @ k.transpose(-2, -1) * scale  # (B, H, T, S)
    if bias is not None:
        scores = scores + bias.to(scores.dtype)  # the bias is built in fp32 (exact distances)
    if normalization == "softmax":
        if mask is not None:
            # A finite fill, not -inf: a row that is masked everywhere then stays finite
            # (uniform), and is zeroed below instead of becoming NaN.
            scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        weights = torch.softmax(scores, dim=-1)  # (B, H, T, S)
    else:
        if mask is None:
            n_keys = torch.full(scores.shape[:-1], scores.shape[-1], device=q.device)
        else:
            n_keys = mask.expand(scores.shape).sum(-1)  # (B, H, T)
        b = -torch.log(n_keys.clamp(min=1).to(scores.dtype))[..., None]  # (B, H, T, 1)
        weights = torch.sigmoid(scores + b)  # (B, H, T, S)
    if mask is not None:
        weights = weights.masked_fill(~mask, 0.0)
    # Dropout regularizes what flows to O; the returned A' stays the normalized weights.
    dropped = layers.dropout(weights, dropout)
    return dropped @ v, weights  # (B, H, T, K), (B, H, T, S)


def attention_fused(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    mask: Tensor | None = None,
    bias: Tensor | None = None,
    dropout: float = 0.0,
    scale: float | None = None,
) -> Tensor:
    """Softmax attention through PyTorch's fused kernel; equal to :func:`attention_explicit`
    (``scale`` as there).

    Fully masked query rows are given one harmless key inside the kernel (so it cannot
    produce NaN) and their output is zeroed afterwards, as the explicit path does. With fewer
    key/value heads than query heads (grouped-query attention) the kernel shares each among
    its H / G query heads itself, so a decoding step does not copy the whole cache H / G times.
    A bfloat16 decoding step over many keys runs in float32, faster (:func:`_float32_is_faster`).

    Shapes:
        q: (B, H, T, K); k, v: (B, G, S, K), G dividing H (G = H: plain multi-head);
        mask, bias as in :func:`attention_explicit`.
        returns: (B, H, T, K).
    """
    attn_mask: Tensor | None = None
    row_valid: Tensor | None = None
    dtype = q.dtype
    if _float32_is_faster(q, k):
        q, k, v = q.float(), k.float(), v.float()  # (B, H, 1, K), (B, G, S, K) twice
    if mask is not None:
        row_valid = mask.any(dim=-1, keepdim=True)  # (B|1, H|1, T, 1)
        mask = mask | ~row_valid  # every row keeps at least one key
        attn_mask = mask
    if bias is not None:
        bias = bias.to(q.dtype)
        attn_mask = bias if mask is None else bias.masked_fill(~mask, float("-inf"))
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=attn_mask, dropout_p=dropout, scale=scale, enable_gqa=bool(k.shape[1] != q.shape[1])
    )  # (B, H, T, K)
    if row_valid is not None and (layers.exporting() or not bool(row_valid.all())):
        out = out * row_valid  # (B, H, T, K)
    return out.to(dtype)


# From this many keys a bfloat16 decoding step's attention runs in float32 (:func:`_float32_is_faster`).
FLOAT32_MIN_KEYS = 64


def _float32_is_faster(q: Tensor, k: Tensor) -> bool:
    """Whether the fused kernel should run on bfloat16 queries, keys and values cast to float32
    (and its output cast back): one query row (a decoding step) on the CPU, no gradients, at
    least :data:`FLOAT32_MIN_KEYS` keys. PyTorch's CPU kernel takes about 0.85 µs a key for one
    bfloat16 query row, against 0.2 µs in float32 with the casts (torch 2.13, H=8, K=64, one
    thread, medians under contention, 2026-12-07: 64 keys 60 against 27 µs, 200 keys 173 against
    62 µs, 1,500 keys 1.42 against 0.45 ms). A bf16 decoder-only model (d512, 6 layers) after a
    500-token prompt: 16.6 against 14.6 ms a token, the same tokens (same-process A/B, one
    thread, under contention). Below 64 keys the kernel is kept: from 16 keys it was faster
    alone, but the base translation step (16 to 33 keys) came out 0.1-0.2 ms slower whole. The
    output is float32's rounded to bfloat16, the most exact bfloat16 answer (tested).
    """
    return (
        q.dtype == torch.bfloat16
        and q.device.type == "cpu"
        and q.shape[-2] == 1
        and k.shape[-2] >= FLOAT32_MIN_KEYS
        and not (torch.is_grad_enabled() and q.requires_grad)
        and not layers.exporting()
    )


def _explicit_is_faster(q: Tensor, k: Tensor) -> bool:
    """Whether softmax attention should take the explicit path although the fused one could.

    PyTorch's CPU fused kernel is slow in bfloat16 when gradients flow: measured on this
    project's machine (2026-12-01, torch 2.13, B=64, H=4-8, K=64), forward + backward took 3-4x
    the explicit path's time for up to 128 keys and about the same at 256. So bf16 training
    (autocast) of short sequences, e.g. translation, takes the explicit path; inference and
    fp32 keep the fused kernel. The two paths are tested equal.
    """
    return (
        q.dtype == torch.bfloat16
        and q.device.type == "cpu"
        and torch.is_grad_enabled()
        and q.requires_grad
        and k.shape[-2] <= 128
    )


def repeat_kv_heads(k: Tensor, v: Tensor, n_heads: int) -> tuple[Tensor, Tensor]:
    """Grouped-query attention on the explicit path (Ainslie et al., 2023, section 2.2): each of
    the G key/value heads repeated for the H / G query heads it serves. The fused kernel shares
    them itself (:func:`attention_fused`), without this copy.

    Shapes:
        k, v: (B, G, S, K), G dividing ``n_heads`` H. returns: (B, H, S, K) each.
    """
    repeat = n_heads // k.shape[1]
    if repeat == 1:
        return k, v
    return k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)  # (B, H, S, K) each


# ------------------------------------------------ keys shared by an input's beams


def beams_as_queries(q: Tensor, w: int) -> Tensor:
    """The queries of an input's ``w`` rows (its beams, consecutive) as one row of W·T queries,
    for keys and values held once per input: beams of one input attend to the same encoder
    output, so cross-attention need not read (nor hold) its keys and values W times.

    Shapes: (B·W, H, T, K) -> (B, H, W·T, K)."""
    n, h, t, d = q.shape
    return q.view(n // w, w, h, t, d).transpose(1, 2).reshape(n // w, h, w * t, d)  # (B, H, W·T, K)


def queries_as_beams(out: Tensor, w: int) -> Tensor:
    """:func:`beams_as_queries` undone on the attention's output. Shapes: (B, H, W·T, K) -> (B·W, H, T, K)."""
    b, h, wt, d = out.shape
    return out.view(b, h, w, wt // w, d).transpose(1, 2).reshape(b * w, h, wt // w, d)  # (B·W, H, T, K)


def shared_expanded(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor | None]:
    """Keys, values and mask held once per input (B rows) repeated for the W consecutive query
    rows of each input (B·W rows): the explicit path of shared keys, and the reference the
    grouped fused path (:func:`beams_as_queries`) is tested against. Unchanged when the rows
    match. Shapes: q (B·W, H, T, K); k, v (B, G, S, K); mask (B|1, 1|H, T|1, S) -> (B·W, ...)."""
    b, w = k.shape[0], rows_per_input(q, k)
    if w == 1:
        return k, v, mask
    if mask is not None and mask.shape[0] == b and b > 1:
        mask = mask.repeat_interleave(w, dim=0)  # (B·W, 1|H, T|1, S)
    return k.repeat_interleave(w, dim=0), v.repeat_interleave(w, dim=0), mask  # (B·W, G, S, K) each


def rows_per_input(q: Tensor, k: Tensor) -> int:
    """W, the query rows that share each row of keys (1: a row each); a ValueError unless it divides.
    Shapes: q (B·W, H, T, K), k (B, G, S, K)."""
    n, b = q.shape[0], k.shape[0]
    if n % b:
        raise ValueError(f"{n} query rows cannot share keys and values of {b} rows")
    return n // b


def _groupable(k: Tensor, mask: Tensor | None, bias: Tensor | None) -> bool:
    """Whether attention to keys ``k`` shared by an input's rows can run as W·T queries per input
    (:func:`beams_as_queries`): no bias, and a mask the same for every query of an input (a
    key-padding mask with one row per input, or one for all)."""
    return bias is None and (mask is None or (mask.shape[-2] == 1 and mask.shape[0] in (1, k.shape[0])))


# --------------------------------------------------------- multi-head attention


def _padded(rows: Tensor, where: Tensor, n: int) -> Tensor:
    """``rows`` written at positions ``where`` of ``n`` rows, zeros elsewhere. Shapes: (N, W), (N,) -> (n, W)."""
    return rows.new_zeros(n, rows.shape[-1]).index_copy_(0, where, rows)  # (n, W)


ATTENTION_PATHS = ("auto", "explicit", "fused")


@contextmanager
def attention_path(model: nn.Module, path: str) -> Iterator[None]:
    """Within the block, every :class:`MultiHeadAttention` of ``model`` takes ``path``:
    "explicit" (the textbook, :func:`attention_explicit`), "fused" (the kernel, wherever it
    can: softmax and no weights asked, whatever :func:`_explicit_is_faster` says) or "auto"
    (the usual choice). ``qkv check`` runs a whole model both ways to compare them; the
    previous paths are restored on leaving."""
    if path not in ATTENTION_PATHS:
        raise ValueError(f"path must be one of {ATTENTION_PATHS}, got {path!r}")
    modules = [m for m in model.modules() if isinstance(m, MultiHeadAttention)]
    before = [m.path for m in modules]
    for m in modules:
        m.path = path
    try:
        yield
    finally:
        for m, was in zip(modules, before, strict=True):
            m.path = was


STACK_MIN_ROWS = 256  # B*T from which self-attention's Q, K, V are one stacked product (see below)


class MultiHeadAttention(nn.Module):
    """Multi-head attention: per-head projections, attention, concatenation, Wᴼ.

    One module for self-attention (``context`` is None: keys and values come from ``x``)
    and cross-attention (keys and values from ``context``, the encoder output). With
    ``n_kv_heads < n_heads`` it is grouped-query attention (Ainslie et al., 2023): each
    key/value head serves ``n_heads // n_kv_heads`` query heads.

    The fused kernel is used unless the weights are requested, the normalization is sigmoid
    (the fused kernel only knows softmax), or it is the slower one (bf16 training of short
    sequences on CPU, :func:`_explicit_is_faster`).

    Args:
        d_model: model width D.
        n_heads: query heads H; D must divide by H unless ``head_dim`` is given.
        n_kv_heads: key/value heads G (default H); H must divide by G.
        head_dim: each head's width K (default D // H; Gemma's heads are wider).
        normalization: "softmax" or "sigmoid".
        dropout: dropout on the attention weights during training.
        bias: whether the four projections have biases.
        key_bias: with ``bias``, whether Wk has one too. A key bias adds q·b to every score of
            a query alike, which softmax cancels, so Whisper leaves it out (its ``k_proj``).
        output_bias: whether Wo has a bias (None: as ``bias``; Qwen2 has biases on Wq, Wk, Wv
            alone).
        rope: rotate queries and keys by their positions (self-attention only): True for
            base 10000 unscaled, or a :class:`Rope` with its base and scaling.
        qk_norm: RMS-normalise each head's queries and keys (learned gains of width K, epsilon
            ``norm_eps``) before RoPE, as Gemma 3 and Qwen 3 do (Dehghani et al., 2023,
            "Scaling Vision Transformers to 22B Parameters", section 3.1).
        scale: scores are Q·Kᵀ times this (None: 1/√K).

    Shapes:
        x (B, T, D) and context (B, S, D) in, (B, T, D) out; see :meth:`forward`.
    """

    def __init__(
        self,
        d_model: int,
        n_heads: int,
        *,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        normalization: str = "softmax",
        dropout: float = 0.0,
        bias: bool = True,
        key_bias: bool = True,
        output_bias: bool | None = None,
        rope: Rope | bool = False,
        qk_norm: bool = False,
        norm_eps: float = 1e-6,
        scale: float | None = None,
    ) -> None:
        super().__init__()
        n_kv_heads = n_kv_heads or n_heads
        if head_dim is None and d_model % n_heads:
            raise ValueError(f"d_model={d_model} is not divisible by n_heads={n_heads}")
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads={n_heads} is not divisible by n_kv_heads={n_kv_heads}")
        if normalization not in NORMALIZATIONS:
            raise ValueError(f"attention must be one of {NORMALIZATIONS}, got {normalization!r}")
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = head_dim or d_model // n_heads
        self.normalization, self.dropout = normalization, layers.check_p(dropout)
        self.rope = Rope() if rope is True else rope or None
        self.scale = scale
        k = self.head_dim
        self.w_q = nn.Linear(d_model, n_heads * k, bias=bias)
        self.w_k = nn.Linear(d_model, n_kv_heads * k, bias=bias and key_bias)
        self.w_v = nn.Linear(d_model, n_kv_heads * k, bias=bias)
        self.w_o = nn.Linear(n_heads * k, d_model, bias=bias if output_bias is None else output_bias)
        self.q_norm = nn.RMSNorm(k, eps=norm_eps) if qk_norm else None
        self.k_norm = nn.RMSNorm(k, eps=norm_eps) if qk_norm else None
        self.w_qkv: nn.Linear | None = None  # [Wq; Wk; Wv] stacked, after fuse_qkv (decoding)
        self.path = "auto"  # or one path forced (:func:`attention_path`: qkv check compares the two)
        # Q, K, V's widths in a stacked product's output: H*K, G*K, G*K.
        self.qkv_widths = [n_heads * k, n_kv_heads * k, n_kv_heads * k]

    def fuse_qkv(self) -> None:
        """Stack Wq, Wk and Wv into one projection ``w_qkv`` (they are removed): self-attention
        then takes one matrix product per call instead of three. Decoding a token at a time is
        bound by per-call overhead, not arithmetic, so this is a decoding fast path; outputs are
        the same up to float rounding. Self-attention only: a fused module refuses a context.
        """
        if self.w_qkv is not None:
            return  # fused already
        if not self._stackable():
            raise ValueError("fuse_qkv needs float nn.Linear projections: fuse before quantizing (int8_linears)")
        with torch.no_grad():
            weight, bias = self._stacked_weights()  # ((H + 2G) * K, D), ((H + 2G) * K,) or None
            fused = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
            fused = fused.to(device=weight.device, dtype=weight.dtype)
            fused.weight.copy_(weight)
            if bias is not None:
                fused.bias.copy_(bias)
        del self.w_q, self.w_k, self.w_v
        self.w_qkv = fused

    def _stack_projections(self, x: Tensor) -> bool:
        """Whether self-attention over ``x`` computes Q, K and V as one product of the stacked
        weights [Wq; Wk; Wv] (the parameters stay three): one wide matrix product, forward and
        backward, is faster on CPU than three narrow ones, and the gradient reaching ``x`` is
        one product instead of three summed (measured 2026-12-01, same-process A/B: 2% per GPT
        training step at width 384, 6% at nanoGPT's CPU configuration). Stacking copies the
        weights each call, which only pays when the product is large: many rows (training, a
        prompt, an encoder), not a decoding step. Tested equal to the three products.
        """
        return x.shape[0] * x.shape[1] >= STACK_MIN_ROWS and self._stackable()

    def _stackable(self) -> bool:
        """Whether Wq, Wk, Wv are float ``nn.Linear`` layers (not int8 ones) that can be stacked."""
        return all(type(p) is nn.Linear for p in (self.w_q, self.w_k, self.w_v))

    def _stacked_weights(self) -> tuple[Tensor, Tensor | None]:
        """[Wq; Wk; Wv] and their biases (None without biases), stacked by output rows; a
        projection without a bias among ones with (Wk with ``key_bias=False``) adds zeros."""
        parts = (self.w_q, self.w_k, self.w_v)
        weight = torch.cat([p.weight for p in parts])  # ((H + 2G) * K, D)
        if all(p.bias is None for p in parts):
            return weight, None
        biases = [p.weight.new_zeros(p.out_features) if p.bias is None else p.bias for p in parts]
        return weight, torch.cat(biases)  # ((H + 2G) * K,)

    def _split(self, x: Tensor, heads: int) -> Tensor:
        b, t, _ = x.shape
        return x.view(b, t, heads, self.head_dim).transpose(1, 2)  # (B, H, T, K)

    def forward(
        self,
        x: Tensor,
        *,
        context: Tensor | None = None,
        mask: Tensor | None = None,
        bias: Tensor | None = None,
        positions: Tensor | None = None,
        cache: KVCache | KVBuffer | None = None,
        need_weights: bool = False,
        rotation: tuple[Tensor, Tensor] | None = None,
    ) -> tuple[Tensor, KVCache | KVBuffer, Tensor | None]:
        """Attend from ``x`` to itself (plus the cache) or to ``context``: project, attend, merge.

        For self-attention, ``cache`` holds the keys/values of earlier positions and the
        returned cache appends this call's. For cross-attention, a given ``cache`` holds
        the keys/values of ``context`` computed by an earlier call and is reused as is, so
        the encoder output is projected once per generated sequence. Such a cache may hold
        fewer rows than ``x`` (B inputs for B·W rows): each input's keys and values are then
        shared by its W consecutive rows (beam search's hypotheses), read once per input.

        Shapes:
            x: (B, T, D); context: (B, S, D).
            mask: bool, broadcastable to (B, H, T, S) where S counts cached keys too.
            bias: float, broadcastable to (B, H, T, S) (ALiBi).
            positions: (B, T) or (T,) positions of x, used by RoPE.
            rotation: RoPE's tables of ``positions`` (:func:`rope_turn`, (B, 1, T, K) twice), when
            the caller computed them once for several layers; None: computed here.
            cache: two (B, G, P, K) tensors, or a :class:`KVBuffer` (self-attention).
            returns: output (B, T, D), new cache (two (B, G, S, K), or the grown
            :class:`KVBuffer` when one was given), and the weights
            (B, H, T, S) when ``need_weights`` (else None).
        """
        if context is None:  # self-attention: Q = x·Wq, K = x·Wk, V = x·Wv
            q, k, v = self._project_self(x, positions, rotation)  # (B, H, T, K), (B, G, T, K), (B, G, T, K)
            k, v, cache = extend_cache(cache, k, v)  # (B, G, S, K) each: cached positions, then x's
        else:  # cross-attention: Q = x·Wq, K = context·Wk, V = context·Wv
            k, v = self._project_context(context, cache)  # (B, G, S, K) each
            cache = (k, v)
            q = self._split(self.w_q(x), self.n_heads)  # (B, H, T, K)
            if self.q_norm is not None:
                q = self.q_norm(q)
        out, weights = self._attend(q, k, v, mask, bias, need_weights)  # (B, H, T, K), (B, H, T, S) or None
        b, _, t, _ = out.shape
        out = out.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim)  # (B, T, H*K): heads concatenated
        return self.w_o(out), cache, weights  # (B, T, D)

    def _project_self(
        self, x: Tensor, positions: Tensor | None, rotation: tuple[Tensor, Tensor] | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Self-attention's queries, keys and values, split into heads, each head's queries and keys
        RMS-normalised (``qk_norm``) and then rotated by RoPE (by ``rotation``, else by the tables
        of ``positions`` in the queries' dtype) where the attention has it. One
        product of the stacked [Wq; Wk; Wv] when fused (:meth:`fuse_qkv`) or when stacking pays
        (:meth:`_stack_projections`), else three products. Stacked queries and keys are adjacent
        heads, so without ``qk_norm`` one rotation turns both.

        Shapes:
            x: (B, T, D). returns: (B, H, T, K), (B, G, T, K), (B, G, T, K).
        """
        return self._heads_self(self._projections(x), positions, rotation)

    def _projections(self, x: Tensor) -> tuple[Tensor, ...]:
        """x·[Wq; Wk; Wv] as one stacked tensor where :meth:`_project_self` stacks them, else
        x·Wq, x·Wk, x·Wv. Shapes: x (B, T, D) -> ((B, T, (H + 2G)·K),) or (B, T, H·K), (B, T, G·K) twice."""
        if self.w_qkv is not None:
            return (self.w_qkv(x),)  # (B, T, (H + 2G)·K)
        if self._stack_projections(x):
            return (F.linear(x, *self._stacked_weights()),)  # (B, T, (H + 2G)·K)
        return self.w_q(x), self.w_k(x), self.w_v(x)  # (B, T, H·K), (B, T, G·K), (B, T, G·K)

    def _heads_self(
        self, projected: tuple[Tensor, ...], positions: Tensor | None, rotation: tuple[Tensor, Tensor] | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`_projections`' output split into heads, normalised and rotated (:meth:`_project_self`).
        Shapes: as :meth:`_projections` returns -> (B, H, T, K), (B, G, T, K), (B, G, T, K)."""
        h, g = self.n_heads, self.n_kv_heads
        if len(projected) == 1:
            qk, v = self._split(projected[0], h + 2 * g).split([h + g, g], dim=1)  # (B, H + G, T, K), (B, G, T, K)
            if self.rope is not None and rotation is None:
                rotation = self.rotation(positions, like=qk)  # (B, 1, T, K) twice
            if self.q_norm is None:
                q, k = self._rotate(qk, rotation).split([h, g], dim=1)  # (B, H, T, K), (B, G, T, K)
                return q, k, v
            q, k = qk.split([h, g], dim=1)  # (B, H, T, K), (B, G, T, K)
        else:
            q, k, v = self._split(projected[0], h), self._split(projected[1], g), self._split(projected[2], g)
            if self.rope is not None and rotation is None:
                rotation = self.rotation(positions, like=q)  # (B, 1, T, K) twice
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)  # each head's queries and keys, RMS-normalised
        return self._rotate(q, rotation), self._rotate(k, rotation), v

    def forward_rows(
        self,
        rows: Tensor,
        *,
        where: Tensor,
        shape: tuple[int, int],
        mask: Tensor | None,
        bias: Tensor | None,
        positions: Tensor | None,
    ) -> Tensor:
        """Self-attention (no cache, no weights) of a padded batch of shape ``shape`` (B, S) given
        its real positions alone: ``rows`` are the positions ``where`` (indices into the B·S
        positions, row-major). The projections Wq, Wk, Wv and Wo multiply the N real rows only;
        attention itself runs on the padded layout, the padding's queries, keys and values zeros
        (``mask`` must keep every real query from the padding's keys). Equal to :meth:`forward`
        at the real positions up to float rounding (tested): a batch of sources of unequal lengths
        spares its padding's share of every product (a fifth to a quarter in bench/mt_speed.py).

        Shapes: rows (N, D); where (N,); mask, bias as in :meth:`forward` over (B, S). Returns (N, D).
        """
        b, s = shape
        padded = tuple(_padded(p[0], where, b * s).view(b, s, -1) for p in self._projections(rows[None]))  # (B, S, ·)
        q, k, v = self._heads_self(padded, positions, None)  # (B, H, S, K), (B, G, S, K), (B, G, S, K)
        out, _ = self._attend(q, k, v, mask, bias, False)  # (B, H, S, K)
        out = out.transpose(1, 2).reshape(b * s, self.n_heads * self.head_dim)  # (B·S, H·K): heads concatenated
        return self.w_o(out.index_select(0, where))  # (N, D)

    def forward_row(
        self, x: Tensor, cache: KVBuffer, rotation: tuple[Tensor, Tensor] | None, window: int | None
    ) -> tuple[Tensor, KVBuffer]:
        """Self-attention of one new position per row that may see every cached key (a decoding
        step, no mask), the newest ``window`` of them where given (a sliding-window layer: one query
        row's window is a slice of the cache, no mask either): :meth:`forward`'s output and grown
        cache without its choices, checks and mask plumbing, the fused kernel always, on rows
        (B, D) rather than (B, 1, D): a product of a 2-D input is one operator, of a 3-D one three
        (a view in, ``mm``, a view out). A decoding fast path (``blocks.DecoderStack.forward_row``),
        tested equal to :meth:`forward`.

        Shapes:
            x: (B, D); cache: a KVBuffer of P positions; rotation: RoPE's tables of the new
            position ((B|1, 1, 1, K) twice), None without RoPE. returns (B, D) and the buffer.
        """
        b, h, g = x.shape[0], self.n_heads, self.n_kv_heads
        projected = self._projections(x)  # ((B, (H + 2G)·K),) or (B, H·K), (B, G·K), (B, G·K)
        if len(projected) == 1 and self.q_norm is None:  # one row per head needs no transpose
            qk, v = projected[0].view(b, h + 2 * g, 1, self.head_dim).split([h + g, g], dim=1)  # (B, H + G, 1, K), ...
            q, k = self._rotate(qk, rotation).split([h, g], dim=1)  # (B, H, 1, K), (B, G, 1, K)
        else:
            q, k, v = self._heads_self(tuple(p[:, None] for p in projected), None, rotation)  # (B, H|G, 1, K)
        k, v, cache = cache.append(k, v)  # (B, G, P + 1, K) each, written in place
        if window is not None and k.shape[2] > window:
            k, v = k[:, :, -window:], v[:, :, -window:]  # (B, G, window, K): the keys the window keeps
        out = attention_fused(q, k, v, scale=self.scale)  # (B, H, 1, K)
        return self.w_o(out.reshape(b, h * self.head_dim)), cache  # (B, D): heads concatenated

    def forward_row_cross(self, x: Tensor, cache: KVCache) -> Tensor:
        """Cross-attention of one new position per row to the keys and values an earlier call
        projected from the encoder output (``cache``, one row of them per query row), every source
        position in sight (no mask: no source is padded): :meth:`forward`'s output with a context
        cache, without its checks, mask plumbing and weights, on rows (B, D). The keys and values
        are read as they are, never projected nor copied again. A decoding fast path
        (``blocks.DecoderStack.forward_row``), tested equal to :meth:`forward`.

        Shapes:
            x: (B, D); cache: (B, G, S, K) twice. returns (B, D).
        """
        b, h = x.shape[0], self.n_heads
        q = self.w_q(x).view(b, h, 1, self.head_dim)  # (B, H, 1, K): one position, so no transpose
        if self.q_norm is not None:
            q = self.q_norm(q)
        out = attention_fused(q, *cache, scale=self.scale)  # (B, H, 1, K)
        return self.w_o(out.reshape(b, h * self.head_dim))  # (B, D): heads concatenated

    def _project_context(self, context: Tensor, cache: KVCache | KVBuffer | None) -> KVCache:
        """Cross-attention's keys and values: ``context`` projected by Wk and Wv, or, given a
        cache, the ones an earlier call projected (the context is the same at every step).

        Shapes:
            context: (B, S, D); cache: two (B, G, S, K). returns: (B, G, S, K) twice.
        """
        if self.w_qkv is not None:
            raise ValueError("this attention's projections are fused for self-attention; it takes no context")
        if isinstance(cache, KVBuffer):
            raise ValueError("a KVBuffer is a self-attention cache; cross-attention takes a (k, v) tuple")
        if cache is not None:
            return cache
        k = self._split(self.w_k(context), self.n_kv_heads)  # (B, G, S, K)
        if self.k_norm is not None:
            k = self.k_norm(k)
        # Each head's keys and values made contiguous once: every decoding step reads them all, and
        # the fused kernel reads a head's S rows about twice as fast from one block as from rows
        # G·K apart (Whisper tiny.en, 1,500 frames: 0.5 against 1.1 ms a layer and step, 2026-12-07).
        return k.contiguous(), self._split(self.w_v(context), self.n_kv_heads).contiguous()  # (B, G, S, K) each

    def context_cache(self, context: Tensor) -> KVCache:
        """Cross-attention's keys and values of ``context``, as its first call caches them: what an
        exported encoder computes once for every decoding step (``onnx_export.py``).

        Shapes: context (B, S, D) -> (B, G, S, K) twice.
        """
        return self._project_context(context, None)

    def rotation(self, positions: Tensor | None, *, like: Tensor) -> tuple[Tensor, Tensor] | None:
        """RoPE's tables (:func:`rope_turn`) of ``positions`` for this attention's heads, in the dtype
        and on the device of ``like`` (the queries, or what they are projected from): what
        :meth:`forward` takes as ``rotation``; None without RoPE.
        Shapes: (B, T) or (T,) -> (B, 1, T, K) twice."""
        if self.rope is None:
            return None
        assert positions is not None, "RoPE needs the positions of x"
        rope = self.rope
        return rope_turn(
            positions, width=self.head_dim, dtype=like.dtype, device=like.device, base=rope.base, scaling=rope.scaling
        )  # (B, 1, T, K) twice

    @staticmethod
    def _rotate(x: Tensor, rotation: tuple[Tensor, Tensor] | None) -> Tensor:
        """RoPE (:func:`rope_apply_rolled`) by ``rotation``'s angles; None: ``x`` as it is.
        Shapes: (B, H, T, K) -> (B, H, T, K)."""
        return x if rotation is None else rope_apply_rolled(x, *rotation)

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, bias: Tensor | None, need_weights: bool
    ) -> tuple[Tensor, Tensor | None]:
        """Every head's attention O = A'·V, and A' when ``need_weights`` (else None): the fused
        kernel unless the weights are wanted, the normalization is sigmoid (the kernel only knows
        softmax), or it is the slower one (:func:`_explicit_is_faster`). The two are tested equal.
        Keys and values of fewer rows than the queries are shared by consecutive query rows (beam
        search's cross-attention: one encoder output per input, B rows for B·W beams); the fused
        path reads them once per input (:func:`beams_as_queries`), the explicit one repeats them.

        Shapes:
            q: (B, H, T, K) (or (B·W, H, T, K)); k, v: (B, G, S, K); mask, bias as in
            :func:`attention_explicit` (mask rows: B). returns: (B, H, T, K) (or (B·W, H, T, K))
            and (B, H, T, S) or None.
        """
        dropout = self.dropout if self.training else 0.0
        fusable = not need_weights and self.normalization == "softmax" and self.path != "explicit"
        if fusable and (self.path == "fused" or not _explicit_is_faster(q, k)):
            if k.shape[0] != q.shape[0] and _groupable(k, mask, bias):  # keys shared by the W beams of an input
                w = rows_per_input(q, k)
                out = attention_fused(beams_as_queries(q, w), k, v, mask=mask, dropout=dropout, scale=self.scale)
                return queries_as_beams(out, w), None  # (B·W, H, T, K)
            k, v, mask = shared_expanded(q, k, v, mask)  # (B, G, S, K) twice, mask with B rows
            out = attention_fused(q, k, v, mask=mask, bias=bias, dropout=dropout, scale=self.scale)  # (B, H, T, K)
            return out, None
        k, v, mask = shared_expanded(q, k, v, mask)  # (B, G, S, K) twice, mask with B rows
        k, v = repeat_kv_heads(k, v, self.n_heads)  # (B, H, S, K) each
        out, weights = attention_explicit(
            q, k, v, mask=mask, bias=bias, normalization=self.normalization, dropout=dropout, scale=self.scale
        )  # (B, H, T, K), (B, H, T, S)
        return out, (weights if need_weights else None)
