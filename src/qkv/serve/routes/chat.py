"""``POST /v1/chat``: a dialogue's next turn, as ``qkv chat`` (an encoder-decoder or a language model).

A language model's reply is decoded by continuous batching (``serve/continuous.py``, the decoding
``/v1/generate`` and the OpenAI routes share): the dialogue read as ``qkv chat`` reads it (its chat
template, else the newest turns joined by ``separator``, within the window), greedy or drawn, ended
at an end-of-turn token or the separator, as ``bundle.reply`` ends it. Decoded directly instead,
alone on the model thread by ``bundle.reply``: an encoder-decoder's reply (a beam search, or a
decoder whose state cannot join a running batch), and a language model's without a chat template
whose separator is only white space (``"\\n"``: ``qkv chat`` cuts the raw text at it, where a reply
decoded in the batch is read stripped of its leading spaces, which would hide a separator there).
"""

from __future__ import annotations

from functools import partial

from fastapi import APIRouter

from qkv.bundle import as_messages
from qkv.serve import completions as c
from qkv.serve import jobs
from qkv.serve import schemas as s
from qkv.serve.answering import answered, batch_key
from qkv.serve.batching import Job
from qkv.serve.models import Served
from qkv.serve.service import Service, Shared
from qkv.serve.validation import validate_chat

router = APIRouter(tags=["chat"])


@router.post("/v1/chat", response_model=s.ChatResponse, responses=s.ERRORS)
async def chat(req: s.ChatRequest, svc: Shared):
    """The next turn of a dialogue (``qkv chat``'s reply: the newest turns that fit the window)."""
    served = svc.pick(req.model, "chat")
    validate_chat(req, svc.settings)
    options = {"temperature": req.temperature, "top_k": req.top_k, "top_p": req.top_p, "sampling": req.sampling()}
    if served.kind != "decoder_only" or (served.bundle.conversation is None and not req.separator.strip()):
        return await replied_alone(svc, served, req, options)  # the direct path (see the module)
    max_new = min(req.max_new_tokens, served.window - 1)  # as chat.reply caps it
    messages = as_messages(req.messages)
    ask = c.chat_ask(served, messages, max_new_tokens=max_new, stops=(), separator=req.separator)
    picking = c.Picking(jobs.sampling_of(options, seed=req.seed))
    key = batch_key(served, picking, batching=svc.settings.batching)
    (answer,) = await answered(svc, req, served, [ask], picking, key, endpoint="chat")
    return s.ChatResponse(model=served.name, reply=answer.text)


async def replied_alone(svc: Service, served: Served, req: s.ChatRequest, options: dict) -> s.ChatResponse:
    """The reply of a dialogue that continuous batching cannot decode (see the module), alone."""
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
