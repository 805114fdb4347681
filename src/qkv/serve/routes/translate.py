"""``POST /v1/translate``: an encoder-decoder's n-best translations, as ``qkv translate``."""

from __future__ import annotations

import time
from functools import partial

from fastapi import APIRouter

from qkv.serve import jobs
from qkv.serve import schemas as s
from qkv.serve.batching import Job
from qkv.serve.service import Shared
from qkv.serve.validation import validate_translate

router = APIRouter(tags=["translate"])


@router.post("/v1/translate", response_model=s.TranslateResponse, responses=s.ERRORS)
async def translate(req: s.TranslateRequest, svc: Shared):
    """Translate one sentence or several with an encoder-decoder (as ``qkv translate``), with
    any constraints: ``prefix`` (every output starts with it), ``ban`` (words never written),
    ``require`` (words every output contains; beam_size 2 or more), ``terms`` ([source, target]
    pairs: the target required of each sentence that holds the source, as ``--terms FILE``)."""
    served = svc.pick(req.model, "translate")
    texts, ids = validate_translate(req, served, svc.settings)
    options = {
        "beam_size": req.beam_size,
        "nbest": req.nbest,
        "length_penalty": req.length_penalty,
        "max_len_a": req.max_len_a,
        "max_len_b": req.max_len_b,
        **req.constraints(),
    }
    job = Job(
        partial(jobs.translate, served, **options),
        texts,
        key=("translate", served.name, *options.values()),
        cost=sum(max(1, len(row)) for row in ids) * req.beam_size,
    )
    start = time.perf_counter()
    found = await svc.run(job, req)
    svc.count_tokens("translate", sum(hyps[0][2] for hyps in found if hyps), time.perf_counter() - start)
    return s.TranslateResponse(
        model=served.name,
        translations=[
            [s.Scored(text=t, score=score) for t, score, _ in hyps if score != float("-inf")] for hyps in found
        ],
    )
