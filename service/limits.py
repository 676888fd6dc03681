"""Pure ASGI middlewares: the request body size limit (chunked bodies too) and 405 with a whole Allow header."""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

from starlette.exceptions import HTTPException

Scope = dict[str, Any]
Message = dict[str, Any]


class _TooLarge(HTTPException):
    """Raised from inside the app's body read; an HTTPException so FastAPI answers 413, not 400."""

    def __init__(self, max_bytes: int):
        super().__init__(413, f"request body larger than {max_bytes} bytes")


class BodySizeLimit:
    def __init__(self, app: Callable[..., Awaitable[None]], max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    too_big = int(value) > self.max_bytes
                except ValueError:
                    too_big = True
                if too_big:
                    await self._reject(send)
                    return
        seen = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge(self.max_bytes)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge:
            if not started:
                await self._reject(send)

    async def _reject(self, send: Callable[[Message], Awaitable[None]]) -> None:
        body = json.dumps({"detail": f"request body larger than {self.max_bytes} bytes"}).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class MethodNotAllowed:
    """405 with an `Allow` header naming every method of the path (OPTIONS included).

    Starlette answers a method a path lacks from the first route whose path matches, so `Allow` named only
    that route's methods (GET for a path that also takes POST and DELETE).
    """

    def __init__(self, app: Callable[..., Awaitable[None]]):
        self.app = app

    async def __call__(self, scope: Scope, receive: Callable[[], Awaitable[Message]],
                       send: Callable[[Message], Awaitable[None]]) -> None:
        if scope["type"] == "http":
            allowed: set[str] = set()
            for route in scope["app"].router.routes:
                methods = getattr(route, "methods", None)
                if methods and route.path_regex.match(scope["path"]):
                    allowed |= methods
            if allowed and scope["method"] not in allowed:
                body = json.dumps({"detail": f"method {scope['method']} not allowed"}).encode()
                await send({"type": "http.response.start", "status": 405,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode()),
                                        (b"allow", ", ".join(sorted(allowed)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
