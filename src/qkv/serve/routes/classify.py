"""``POST /v1/classify``: an encoder-only classifier's label per text."""

from __future__ import annotations

from functools import partial

from fastapi import APIRouter

from qkv.serve import jobs
from qkv.serve import schemas as s
from qkv.serve.batching import Job
from qkv.serve.service import Shared
from qkv.serve.validation import validate_texts_request

router = APIRouter(tags=["classify"])


@router.post("/v1/classify", response_model=s.ClassifyResponse, responses=s.ERRORS)
async def classify(req: s.ClassifyRequest, svc: Shared):
    """A label per text from an encoder-only classifier (its config.json's label names)."""
    served = svc.pick(req.model, "classify")
    texts, ids = validate_texts_request(req, served, svc.settings)
    job = Job(partial(jobs.classify, served), texts, key=("classify", served.name), cost=sum(len(r) + 2 for r in ids))
    return s.ClassifyResponse(model=served.name, labels=await svc.run(job, req))
