"""The API's errors: one JSON shape for every answer other than 200, built from safe words.

What is here: :class:`ApiError` (raised by validation and the routes), :func:`error_body` (the
shape, ``{"error": {"code", "type", "message"}}``), :func:`described` (a client's text as an
error may show it: ASCII, short), :func:`validation_message` and :func:`validation_detail` (a
422 from pydantic's errors without the input they hold), and :func:`add_handlers`, which answers
the app's exceptions in that shape (a bug's 500 is ``middleware.Observe``'s).

An error body never copies what a client sent: a value the client sent may be a megabyte, a
non-finite number (which JSON cannot hold) or a lone surrogate (which UTF-8 cannot), and the
error would fail in its turn. Field names and model names appear through :func:`described`.

What is not here: the HTTP layer's own errors before a request reaches the app (``http.py``).
"""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from qkv.errors import UserError

SHOWN = 40  # characters of a client's text an error shows at most
KINDS = {400: "invalid_request", 401: "unauthorized", 404: "not_found", 405: "method_not_allowed"}


class ApiError(Exception):
    """An answer other than 200: its status code, a short type and a sentence."""

    def __init__(self, code: int, kind: str, message: str, *, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.code, self.kind, self.message, self.headers = code, kind, message, headers


def error_body(code: int, kind: str, message: str) -> dict:
    return {"error": {"code": code, "type": kind, "message": message}}


class ErrorJSON(JSONResponse):
    """A JSON answer written in ASCII: a message that quotes a library's words (a UserError)
    stays valid JSON and valid UTF-8 whatever characters those hold."""

    def render(self, content: object) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def error_response(code: int, kind: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    return ErrorJSON(error_body(code, kind, message), code, headers=headers)


def described(value: object) -> str:
    """A client's text as an error shows it: its ``ascii`` repr (no control character, no
    surrogate), cut to :data:`SHOWN` characters with the length said; other values by type."""
    if not isinstance(value, str | int):
        return type(value).__name__
    shown = ascii(value)
    if len(shown) <= SHOWN:
        return shown
    size = f"{len(value)} characters" if isinstance(value, str) else f"{len(str(value))} digits"
    return f"{shown[: SHOWN - 1]}… ({size})"


def _parts(loc: tuple) -> list[str | int]:
    """A pydantic error's location without 'body', each field name in safe words."""
    return [p if isinstance(p, int) else _field(p) for p in loc if p != "body"]


def _where(loc: tuple) -> str:
    """A pydantic error's location as text: 'text', 'messages.3'; 'body' for the whole body."""
    return ".".join(str(p) for p in _parts(loc)) or "body"


def _field(name: object) -> str:
    """A field name as an error shows it: as it is when it is a plain short name, else described."""
    text = str(name)
    if text.isascii() and text.replace("_", "").replace("[", "").replace("]", "").isalnum() and len(text) <= SHOWN:
        return text
    return described(text)


def validation_detail(errors: list) -> list[dict]:
    """Pydantic's errors without their input or context: where, which rule, its sentence."""
    return [
        {"loc": _parts(e.get("loc", ())), "type": str(e.get("type", "")), "msg": str(e.get("msg", ""))}
        for e in errors[:20]
    ]


def validation_message(errors: list) -> str:
    """The first problems of a request body, one clause each: 'text: String should have ...'."""
    parts = [f"{_where(e.get('loc', ()))}: {e.get('msg', 'invalid')}" for e in errors[:3]]
    return "; ".join(parts) + (f" (and {len(errors) - 3} more)" if len(errors) > 3 else "")


def add_handlers(app: FastAPI) -> None:
    """Answer the app's exceptions in the JSON shape: ApiError as it says; a bad field 422 (which
    fields, never their values); Starlette's HTTP errors (404, 405, a body that does not parse)
    with their code; a UserError from the library 422. Anything else is a bug: the outermost
    middleware answers it 500 and logs it (``middleware.Observe``)."""

    @app.exception_handler(ApiError)
    async def api_error(request: Request, e: ApiError):
        return error_response(e.code, e.kind, e.message, e.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        body = error_body(422, "invalid_request", validation_message(e.errors()))
        body["error"]["detail"] = validation_detail(e.errors())
        return ErrorJSON(body, 422)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, e: HTTPException):
        kind = KINDS.get(e.status_code, "http_error")
        return error_response(e.status_code, kind, str(e.detail), e.headers)

    @app.exception_handler(UserError)
    async def user_error(request: Request, e: UserError):
        return error_response(422, "invalid_request", str(e))
