"""``POST /v1/chat``: a dialogue's next turn, as ``qkv chat`` (an encoder-decoder or a language model)."""

from __future__ import annotations

from functools import partial

from fastapi import APIRouter

from qkv.serve import jobs
from qkv.serve import schemas as s
from qkv.serve.batching import Job
from qkv.serve.service import Shared
from qkv.serve.validation import validate_chat

router = APIRouter(tags=["chat"])


@router.post("/v1/chat", response_model=s.ChatResponse, responses=s.ERRORS)
async def chat(req: s.ChatRequest, svc: Shared):
    """The next turn of a dialogue (``qkv chat``'s reply: the newest turns that fit the window)."""
    served = svc.pick(req.model, "chat")
    validate_chat(req, svc.settings)
    options = {"temperature": req.temperature, "top_k": req.top_k, "top_p": req.top_p, "sampling": req.sampling()}
    reply = partial(
        jobs.chat,
        served,
        separator=req.separator,
        max_new_tokens=req.max_new_tokens,
        beam_size=req.beam_size,
        seed=req.seed,
        options=options,
    )
    (answer,) = await svc.run(Job(reply, [req.messages]), req)
    return s.ChatResponse(model=served.name, reply=answer)
