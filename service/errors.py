"""Error answers in the user's terms: each bad request gets one line that says what is wrong and where.

FastAPI's defaults answer a body that is not JSON with 422 'JSON decode error', a JSON body sent as a
form (curl's `-d` without a content type) with 'Input should be a valid dictionary', a name outside its
pattern with the regular expression, a path no route has with 'Not Found', and they ignore a query
parameter the route does not take (`?tial=5`: the default tail, silently); a string with an escaped lone
surrogate ("\\ud800", which Python's JSON parser takes) made their 422 a 500 (no UTF-8 answer can echo it).
Here: 400 for a body that is not JSON (such a string included), 415 for a body that is not sent as JSON, the
names' own rules (service/names.py), 404 naming the method and path, and 422 naming an unknown query parameter
(or a one-value one given twice) with the ones the route takes, as its OpenAPI document lists them. Every other
422 keeps FastAPI's list shape.
"""

from __future__ import annotations

import math
from email.message import Message
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Request
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
    unpaired = next((e for e in errors if e.get("type") == "string_unicode"), None)
    if unpaired is not None:
        # NOTE: Python's JSON parser takes an escaped lone surrogate ("\\ud800"), which no UTF-8 answer can echo
        where = ".".join(map(str, unpaired["loc"])).encode("ascii", "backslashreplace").decode()
        return JSONResponse({"detail": f"request body is not valid JSON: {where} holds an unpaired surrogate (text "
                                       "must be Unicode)"}, status_code=400)
    out = []
    for e in errors:
        if tuple(e.get("loc", ())) == ("body",) and e.get("type") == "missing":
            e = {**e, "msg": "request body is missing: expected a JSON object"}
        rule = _rule(e)
        out.append({**e, "msg": rule} if rule else e)
    return JSONResponse({"detail": finite(jsonable_encoder(out))}, status_code=422)


def finite(obj: Any) -> Any:
    """`obj` with its non-finite floats as null, for a JSON answer: JSON has no NaN or Infinity (a NaN loss must not
    break the API, and an error that echoes its input, which Python's JSON parser took as NaN, was a 500)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


async def not_found(request: Request, exc: StarletteHTTPException) -> Response:
    if exc.status_code == 404 and exc.detail == "Not Found":  # the router's: no route has this path
        return JSONResponse({"detail": f"no endpoint {request.method} {request.url.path}; the API is listed at "
                                       "/docs"}, status_code=404)
    return await http_exception_handler(request, exc)


def _takes_many(schema: Any) -> bool:
    """Whether a parameter's JSON schema is an array (a list parameter, repeated in the query)."""
    if isinstance(schema, dict):
        return schema.get("type") == "array" or any(_takes_many(s) for s in schema.get("anyOf", ()))
    return False


def _query_parameters(app: FastAPI, path: str, method: str) -> dict[str, bool] | None:
    """name -> takes several values, for the query parameters the OpenAPI document lists for this route; None for a
    route it does not list (the web page)."""
    operation = app.openapi().get("paths", {}).get(path, {}).get(method.lower())
    if operation is None:
        return None
    return {p["name"]: _takes_many(p.get("schema")) for p in operation.get("parameters", []) if p.get("in") == "query"}


async def reject_unknown_query(request: Request) -> None:
    """Every route's dependency: 422 for a query parameter the route does not take, or a one-value parameter
    given more than once (FastAPI would ignore the first, or the parameter, without a word)."""
    route = request.scope.get("route")
    if route is None or not request.query_params:
        return
    path = getattr(route, "path_format", request.url.path)
    taken = _query_parameters(request.app, path, request.method)
    if taken is None:
        return
    allowed = f"it takes {', '.join(taken)}" if taken else "it takes none"
    for name in dict.fromkeys(request.query_params.keys()):
        if name not in taken:
            msg = f"unknown query parameter {name!r} for {request.method} {path}; {allowed}"
            raise HTTPException(422, [{"loc": ["query", name], "msg": msg, "type": "extra_forbidden"}])
        given = len(request.query_params.getlist(name))
        if given > 1 and not taken[name]:
            msg = f"query parameter {name!r} given {given} times for {request.method} {path}; it takes one value"
            raise HTTPException(422, [{"loc": ["query", name], "msg": msg, "type": "value_error"}])


def install(app: FastAPI) -> None:
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, not_found)
