"""``POST /v1/embed``: an encoder-only model's sentence vectors, as ``qkv embed``."""

from __future__ import annotations

from functools import partial

from fastapi import APIRouter

from qkv.serve import jobs
from qkv.serve import schemas as s
from qkv.serve.batching import Job
from qkv.serve.service import Shared
from qkv.serve.validation import validate_texts_request

router = APIRouter(tags=["embed"])


@router.post("/v1/embed", response_model=s.EmbedResponse, responses=s.ERRORS)
async def embed(req: s.EmbedRequest, svc: Shared):
    """Sentence vectors from an encoder-only model (as ``qkv embed``)."""
    served = svc.pick(req.model, "embed")
    texts, ids = validate_texts_request(req, served, svc.settings)
    job = Job(
        partial(jobs.embed, served, pooling=req.pooling, normalize=req.normalize),
        texts,
        key=("embed", served.name, req.pooling, req.normalize),
        cost=sum(len(row) + 2 for row in ids),  # BEGIN and END
    )
    found = await svc.run(job, req)
    return s.EmbedResponse(model=served.name, embeddings=[v for v, _ in found], settings=found[0][1])
