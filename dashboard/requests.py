"""Reading a request's JSON body and answering errors, for every endpoint of the app.

The guard (``guard.DashboardGuard``) has already bounded the body's size and
nesting; what is left here is its shape and each field's type and range.
"""

from __future__ import annotations

import json
import math
from typing import Any, cast

from starlette.requests import Request
from starlette.responses import JSONResponse

MAX_BODY_BYTES = 1 << 20


class BadRequest(ValueError):
    """A body or field the endpoint cannot take; the message says which and why (a 400), and
    ``param`` names the field, if one."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def error(status: int, message: str, **extra: Any) -> JSONResponse:
    return JSONResponse({"error": message, **extra}, status_code=status)


_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 408: "invalid_request_error",
                413: "invalid_request_error", 415: "invalid_request_error",
                421: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable",
                505: "invalid_request_error"}


def is_openai_path(path: str) -> bool:
    """Whether ``path`` is under ``/v1``, where every error takes OpenAI's shape."""
    return path == "/v1" or path.startswith("/v1/")


def openai_error_body(status: int, message: str, param: str | None = None) -> dict[str, Any]:
    """``{"error": {"message", "type", "param", "code"}}``, as OpenAI's clients read an error."""
    kind = _ERROR_TYPES.get(status, "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": None}}


def openai_error(status: int, message: str, *, param: str | None = None, **extra: Any) -> JSONResponse:
    """An error in OpenAI's shape (``/v1/...``), so its clients show the message and the field;
    ``extra`` goes beside ``error`` (``missing``, for a 503)."""
    return JSONResponse({**openai_error_body(status, message, param), **extra}, status_code=status)


async def json_body(request: Request) -> dict:
    """The body as a JSON object, read as UTF-8 text."""
    raw = await request.body()
    try:
        body = json.loads(raw.decode("utf-8") or "null", parse_int=_integer)
    except BadRequest:
        raise
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequest("body must be a JSON object")
    try:  # JSON's escapes can spell half a UTF-16 pair ("\\udcff"), which is no text at all
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as exc:
        raise BadRequest(f"body holds a lone surrogate (\\u{ord(exc.object[exc.start]):04x}), "
                         "which is not text: send UTF-8, or escape whole surrogate pairs") from None
    return body


MAX_INT_DIGITS = 64  # far past any count, seed or limit a request holds


def _integer(digits: str) -> int:
    """A JSON integer, refused past MAX_INT_DIGITS digits before Python converts it (which
    takes time quadratic in its length, and past 4300 digits fails in Python's own words)."""
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise BadRequest(f"body holds an integer of {len(digits.lstrip('-'))} digits; at most "
                         f"{MAX_INT_DIGITS} are taken")
    return int(digits)


_KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def field(body: dict, name: str, kind: type, default: Any, *, low: float | None = None,
          high: float | None = None) -> Any:
    """``body[name]`` of type ``kind`` (an int is taken for a float), within [low, high]; null
    is the default, as OpenAI's API takes it."""
    value: Any = body.get(name)
    if value is None:
        return default
    if kind is float and type(value) is int:
        value = float(value)
    if type(value) is not kind:
        raise BadRequest(f"{name!r} must be {_KINDS.get(kind, kind.__name__)}", name)
    if kind in (int, float):
        number = cast(float, value)
        if kind is float and not math.isfinite(number):
            raise BadRequest(f"{name!r} must be finite", name)
        if (low is not None and number < low) or (high is not None and number > high):
            raise BadRequest(f"{name!r} must be within [{low}, {high}]", name)
    return value
