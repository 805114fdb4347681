"""``POST /v1/attention``: every attention map of one input, and the beam search's trace."""

from __future__ import annotations

from functools import partial

from fastapi import APIRouter

from qkv.serve import schemas as s
from qkv.serve.attention import TooLong, attention_view
from qkv.serve.batching import Job
from qkv.serve.errors import ApiError
from qkv.serve.service import Shared
from qkv.serve.validation import validate_attention

router = APIRouter(tags=["attention"])


@router.post("/v1/attention", response_model=s.AttentionResponse, responses=s.ERRORS)
async def attention(req: s.AttentionRequest, svc: Shared):
    """Every attention map of one input, through the explicit path: an encoder-decoder's
    encoder self-attention, decoder masked self-attention and cross-attention (rows: the
    tokens the decoder writes; columns: what it reads), a decoder-only model's masked
    self-attention, an encoder-only model's self-attention; every layer and head. Without
    ``output`` the model's own output is decoded first (beam search of ``beam_size``, its
    trace with ``"trace": true``)."""
    served = svc.pick(req.model, "attention")
    validate_attention(req, served, svc.settings)
    view = partial(
        attention_view,
        served,
        output=req.output,
        beam_size=req.beam_size,
        length_penalty=req.length_penalty,
        max_new_tokens=req.max_new_tokens,
        trace=req.trace,
    )
    try:
        (found,) = await svc.run(Job(view, [req.text]), req)
    except TooLong as e:
        raise ApiError(422, "too_long", str(e)) from None
    return s.AttentionResponse(model=served.name, kind=served.kind, **found)
