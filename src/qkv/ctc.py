"""CTC maths for decoding (Graves et al., 2006): the collapse of a path to its labels, best-path
decoding, and the CTC prefix scores that joint CTC/attention beam search adds to the decoder's
(Watanabe et al., 2017).

What is here: :func:`ctc_collapse`, :func:`ctc_best_path`, :class:`CTCPrefixes` (the CTC side of
a beam's hypotheses) and :class:`CTCPrefixScorer`. Pure functions of per-frame log-probabilities:
no model, no search.

What is not here: the CTC head (``models/speech.py``), the CTC loss (``losses.py``), beam
search and CTC-only decoding of a model (``decoding/``: the scorer ``CTCPrefixScore``,
``ctc_greedy``).

Shapes use the legend of ``attention.py``: B utterances, S encoder frames, V vocabulary, N
hypotheses, C candidate tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


def ctc_collapse(labels: Sequence[int], *, blank: int) -> list[int]:
    """The tokens a CTC path stands for: repeated labels merged, then blanks dropped (the map B
    of Graves et al., 2006, section 3.1)."""
    out: list[int] = []
    previous = None
    for label in labels:
        if label != previous and label != blank:
            out.append(label)
        previous = label
    return out


def ctc_best_path(logits: Tensor, valid: Tensor, *, blank: int) -> list[list[int]]:
    """Best-path CTC decoding: the most likely label at each real frame, collapsed.

    Shapes: logits (B, S, V) (or log-probabilities), valid (B, S) bool -> B token lists.
    """
    best = logits.argmax(-1)  # (B, S)
    return [ctc_collapse(row[real].tolist(), blank=blank) for row, real in zip(best, valid, strict=True)]


@dataclass(frozen=True)
class CTCPrefixes:
    """The CTC side of N hypotheses of one length (beam search extends them all at once).

    gamma: (S, 2, N) log γⁿ_t and log γᵇ_t: the probability that frames 0..t read exactly the
        prefix, frame t being its last token (n) or a blank (b).
    score: (N,) log ψ, the prefix probability (that the CTC output begins with the prefix).
    last: (N,) the last token of each prefix (-1: empty).
    inputs: (N,) which input (row of the scorer's log-probabilities) each hypothesis reads.
    length: L, the tokens of every prefix.
    """

    gamma: Tensor
    score: Tensor
    last: Tensor
    inputs: Tensor
    length: int


class CTCPrefixScorer:
    """CTC prefix scores (Watanabe et al., 2017, Algorithm 2), in log space and batched over
    hypotheses and candidate tokens, as ESPnet's ``CTCPrefixScoreTH``.

    For a prefix g and a token c, ψ(g + c) sums the probability of every alignment whose
    labels begin with g + c. One pass over the frames gives it from g's forward variables,
    with ⊕ the log-sum and x_t the frame's log-probabilities:
        φ_t = γᵇ_t(g) ⊕ γⁿ_t(g), or γᵇ_t(g) alone when c repeats g's last token (a blank must
              separate the two);
        γⁿ_t(g + c) = (γⁿ_{t−1}(g + c) ⊕ φ_{t−1}) + x_t(c);
        γᵇ_t(g + c) = (γⁿ_{t−1}(g + c) ⊕ γᵇ_{t−1}(g + c)) + x_t(blank);
        ψ(g + c) = ⊕_t (φ_{t−1} + x_t(c)),  with φ_{−1} = 0 (probability 1) for the empty g only.
    END scores ψ(g + END) = γⁿ_{S−1}(g) ⊕ γᵇ_{S−1}(g), the probability of exactly g; the blank
    scores −∞. Frames past an utterance's end emit the blank with probability 1 (ESPnet's
    padding), which carries every γ unchanged to the last frame, so S − 1 ends every utterance.

    Shapes:
        log_probs: (B, S, V) per-frame log-probabilities (a CTC head's log-softmax).
        valid: (B, S) bool, each utterance's real frames first.
    """

    def __init__(self, log_probs: Tensor, valid: Tensor, *, blank: int, eos: int) -> None:
        x = log_probs.float().masked_fill(~valid[..., None], float("-inf"))  # (B, S, V)
        x[..., blank] = x[..., blank].masked_fill(~valid, 0.0)  # padding: a certain blank
        self.x = x.transpose(0, 1).contiguous()  # (S, B, V): the recursions step over frames
        self.x_blank = self.x[..., blank]  # (S, B)
        self.blank, self.eos = blank, eos

    def initial(self, inputs: Tensor) -> CTCPrefixes:
        """The empty prefix of N hypotheses reading ``inputs`` (N,): only blanks so far."""
        n, frames = len(inputs), self.x.shape[0]
        gamma = self.x.new_full((frames, 2, n), float("-inf"))  # (S, 2, N)
        gamma[:, 1] = self.x_blank[:, inputs].cumsum(0)  # (S, N)
        return CTCPrefixes(gamma, self.x.new_zeros(n), torch.full_like(inputs, -1), inputs, 0)

    def score(self, prefixes: CTCPrefixes, candidates: Tensor) -> tuple[Tensor, Tensor]:
        """ψ of every hypothesis extended by each of its candidate tokens, and their γ.

        Shapes: candidates (N, C) token ids -> ψ (N, C), γ (S, 2, N, C).
        """
        frames = self.x.shape[0]
        x_c = self.x[:, prefixes.inputs[:, None], candidates]  # (S, N, C)
        x_b = self.x_blank[:, prefixes.inputs, None]  # (S, N, 1)
        g_n, g_b = prefixes.gamma[:, 0, :, None], prefixes.gamma[:, 1, :, None]  # (S, N, 1) each
        repeat = (candidates == prefixes.last[:, None])[None]  # (1, N, C)
        phi = torch.where(repeat, g_b, torch.logaddexp(g_n, g_b))  # (S, N, C)
        gamma = self.x.new_full((frames, 2, *candidates.shape), float("-inf"))  # (S, 2, N, C)
        # L + 1 tokens need L + 1 frames: before frame L every γ is −∞, so the pass starts there.
        start = min(max(prefixes.length, 1), frames)
        if prefixes.length == 0:
            gamma[0, 0] = x_c[0]  # φ_{−1} = 0: the first token may be read at frame 0
        for t in range(start, frames):
            gamma[t, 0] = torch.logaddexp(gamma[t - 1, 0], phi[t - 1]) + x_c[t]  # (N, C)
            gamma[t, 1] = torch.logaddexp(gamma[t - 1, 0], gamma[t - 1, 1]) + x_b[t]  # (N, C)
        first = gamma[start - 1, 0][None]  # (1, N, C): the empty prefix's first token read at frame 0, else −∞
        terms = torch.cat([first, phi[start - 1 : frames - 1] + x_c[start:]])  # (S + 1 - start, N, C)
        psi = torch.logsumexp(terms, dim=0)  # (N, C)
        exactly = torch.logaddexp(g_n[-1], g_b[-1])  # (N, 1): the probability of exactly g
        psi = torch.where(candidates == self.eos, exactly, psi)  # (N, C)
        return psi.masked_fill(candidates == self.blank, float("-inf")), gamma

    @staticmethod
    def extend(
        prefixes: CTCPrefixes, psi: Tensor, gamma: Tensor, *, rows: Tensor, candidates: Tensor, tokens: Tensor
    ) -> CTCPrefixes:
        """The prefixes beam search keeps: row i is hypothesis ``rows[i]`` extended by ``tokens[i]``,
        one of its ``candidates`` (a token that is not, e.g. a finished input's filler, gets the
        first candidate's values; its score is −∞ anyway).

        Shapes: psi (N, C), gamma (S, 2, N, C) from :meth:`score`, candidates (N, C); rows,
        tokens (N',).
        """
        index = (candidates[rows] == tokens[:, None]).int().argmax(1)  # (N',): the token's place
        return CTCPrefixes(
            gamma[:, :, rows, index],  # (S, 2, N')
            psi[rows, index],  # (N',)
            tokens,
            prefixes.inputs[rows],
            prefixes.length + 1,
        )
