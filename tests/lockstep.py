"""What the decoding tests share (tests/test_generation.py, tests/test_speech_model.py): two
decoders stepped greedily in lockstep, fed the same tokens, their logits compared at every step
(a fast path against the explicit one)."""

from __future__ import annotations

import torch


def greedy_in_step(first, state_a, second, state_b, logits, steps: int, *, atol: float):
    """``steps`` greedy steps of two decoders fed the same tokens (the first's argmax), from the
    same start ``logits`` (N, V): every step's logits equal within ``atol``. Returns both final states."""
    a = b = logits  # (N, V)
    for _ in range(steps):
        torch.testing.assert_close(b, a, atol=atol, rtol=0)
        tokens = a.argmax(-1)  # (N,)
        (a, state_a), (b, state_b) = first.step(state_a, tokens), second.step(state_b, tokens)
    torch.testing.assert_close(b, a, atol=atol, rtol=0)
    return state_a, state_b
