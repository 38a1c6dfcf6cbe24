"""ASGI middleware: the API key and the request body limit.

Plain ASGI, not Starlette's `@app.middleware("http")`: that wrapper hides the client's `http.disconnect` from the
endpoint, so a non-streaming request could not notice its client leaving.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

ErrorResponse = Callable[..., JSONResponse]


class ApiKeyAuth:
    """Requests to the API paths must carry `Authorization: Bearer <key>`; the page, /health and /metrics need none."""

    PROTECTED = ("/v1", "/tokenize", "/detokenize")

    def __init__(self, app: ASGIApp, api_key: str, error_response: ErrorResponse) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.error_response = error_response

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(self.PROTECTED) and scope["method"] != "OPTIONS":
            supplied = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(supplied, self.expected):
                message = "missing or wrong API key: send 'Authorization: Bearer <key>'"
                await self.error_response(401, message, code="invalid_api_key")(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimit:
    """Reads the whole body before the app sees it and answers 413 once it passes `max_bytes`, whether or not the
    client sent a Content-Length (a chunked body has none). The app then gets the body in one message, and every
    later `receive` (the disconnect) from the client as usual."""

    def __init__(self, app: ASGIApp, max_bytes: int, error_response: ErrorResponse) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.error_response = error_response

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_large = self.error_response(413, f"request body over the limit of {self.max_bytes} bytes")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_bytes):
            await too_large(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body: nothing to answer
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await too_large(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body_sent = False

        async def replay() -> Message:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
