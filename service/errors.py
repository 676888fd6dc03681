"""Error answers in the user's terms: each bad request gets one line that says what is wrong and where.

FastAPI's defaults answer a body that is not JSON with 422 'JSON decode error', a JSON body sent as a
form (curl's `-d` without a content type) with 'Input should be a valid dictionary', a name outside its
pattern with the regular expression, and a path no route has with 'Not Found'. Here: 400 for a body
that is not JSON, 415 for a body that is not sent as JSON, the names' own rules (service/names.py), and
404 naming the method and path. Every other 422 keeps FastAPI's list shape.
"""

from __future__ import annotations

from email.message import Message
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.encoders import jsonable_encoder
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from service import names


def _is_json(content_type: str | None) -> bool:
    """Whether FastAPI parses a body of this content type as JSON (none given counts as JSON)."""
    if not content_type:
        return True
    m = Message()
    m["content-type"] = content_type
    subtype = m.get_content_subtype()
    return m.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def _rule(error: dict[str, Any]) -> str | None:
    """The names module's own line for a value outside a name pattern, instead of the pattern itself."""
    loc, value = tuple(error.get("loc", ())), error.get("input")
    if error.get("type") not in ("string_pattern_mismatch", "string_too_long") or not isinstance(value, str):
        return None
    try:
        if loc in (("body", "name"), ("path", "run_id")):
            names.check_run_id(value)
        elif loc == ("body", "recipe"):
            names.recipe_path(Path("."), value)
        elif loc[:2] == ("body", "overrides") and loc[-1] == "[key]":
            names.check_override(value, "")
    except ValueError as e:
        return str(e)
    return None


async def validation_error(request: Request, exc: RequestValidationError) -> Response:
    errors = exc.errors()
    if any(e.get("loc", ())[:1] == ("body",) for e in errors) and not _is_json(request.headers.get("content-type")):
        return JSONResponse({"detail": f"content-type {request.headers['content-type']!r}: the body must be sent as "
                                       "application/json"}, status_code=415)
    bad_json = next((e for e in errors if e.get("type") == "json_invalid"), None)
    if bad_json is not None:
        at = bad_json["loc"][1] if len(bad_json["loc"]) > 1 else 0
        why = (bad_json.get("ctx") or {}).get("error", "not valid JSON")
        return JSONResponse({"detail": f"request body is not valid JSON: {why} (at character {at})"}, status_code=400)
    out = []
    for e in errors:
        if tuple(e.get("loc", ())) == ("body",) and e.get("type") == "missing":
            e = {**e, "msg": "request body is missing: expected a JSON object"}
        rule = _rule(e)
        out.append({**e, "msg": rule} if rule else e)
    return JSONResponse({"detail": jsonable_encoder(out)}, status_code=422)


async def not_found(request: Request, exc: StarletteHTTPException) -> Response:
    if exc.status_code == 404 and exc.detail == "Not Found":  # the router's: no route has this path
        return JSONResponse({"detail": f"no endpoint {request.method} {request.url.path}; the API is listed at "
                                       "/docs"}, status_code=404)
    return await http_exception_handler(request, exc)


def install(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, not_found)
