"""The page and the service's own endpoints: ``GET /``, ``/app.js``, ``/style.css``, ``/health``,
``/metrics`` and ``/v1/models`` (qkv's fields and OpenAI's ``object``/``data`` beside them). None
takes a slot."""

from __future__ import annotations

from functools import cache
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

from qkv.serve import schemas as s
from qkv.serve.examples import example_input
from qkv.serve.models import Served
from qkv.serve.service import Shared

router = APIRouter(tags=["service"])


@cache
def static_file(name: str) -> bytes:
    """A file of ``static/``, read once."""
    return resources.files("qkv.serve").joinpath("static", name).read_bytes()


def page(name: str, media: str) -> Response:
    return Response(static_file(name), media_type=f"{media}; charset=utf-8", headers={"Cache-Control": "no-cache"})


@router.get("/", include_in_schema=False)
async def index():
    return page("index.html", "text/html")


@router.get("/app.js", include_in_schema=False)
async def script():
    return page("app.js", "text/javascript")


@router.get("/style.css", include_in_schema=False)
async def style():
    return page("style.css", "text/css")


@router.get("/health", response_model=s.Health)
async def health(svc: Shared):
    waiting = len(svc.batcher.waiting) + len(svc.scheduler.waiting)  # jobs, and requests yet to join a decoding
    return s.Health(status="ok", models=len(svc.models), active=svc.slots.active, waiting=waiting)


@router.get("/metrics", include_in_schema=False)
async def prometheus(svc: Shared):
    return Response(svc.metrics.render(), media_type=svc.metrics.content_type)


@router.get("/v1/models", response_model=s.ModelsResponse)
async def list_models(svc: Shared):
    return s.ModelsResponse(
        models=[
            s.ModelInfo(
                name=m.name,
                kind=m.kind,
                endpoints=[f"/v1/{e}" for e in m.endpoints],
                window=m.window,
                layers=m.layers(),
                heads=m.model.config.n_heads,
                labels=m.labels,
                task=m.bundle.meta.get("task"),
                example=example_input(m),
            )
            for m in svc.models.values()
        ],
        data=[s.OpenAIModel(id=m.name, created=written(m)) for m in svc.models.values()],
    )


def written(served: Served) -> int:
    """When a model's directory was written: its config.json's time (Unix seconds)."""
    return int((served.bundle.path / "config.json").stat().st_mtime)
