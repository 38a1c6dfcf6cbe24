"""The OpenAI-compatible HTTP server (FastAPI) and the demo page.

Errors use OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with 4xx for anything the client
can fix. Nothing a client sends reaches the engine thread unvalidated, so no request can stop the engine loop.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagellm import __version__
from pagellm.engine.async_llm import AsyncLLM, EngineDeadError
from pagellm.errors import InvalidParameter
from pagellm.server.metrics import ServerMetrics
from pagellm.server.middleware import ApiKeyAuth, BodyLimit
from pagellm.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from pagellm.server.serving import Job, OpenAIServing

STATIC = Path(__file__).parent / "static"
DEFAULT_MAX_BODY_BYTES = 4 * 2**20
_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    413: "RequestTooLargeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


def error_response(status: int, message: str, param: str | None = None, code: str | int | None = None) -> JSONResponse:
    body = {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status, "BadRequestError"),
            "param": param,
            "code": code if code is not None else status,
        }
    }
    return JSONResponse(body, status_code=status)


def create_app(
    llm: AsyncLLM,
    model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    allowed_origins: list[str] | None = None,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
) -> FastAPI:
    app = FastAPI(title="pagellm", version="0.1.0")
    metrics = ServerMetrics(model_name)
    serving = OpenAIServing(llm, model_name, metrics, tool_call_parser, reasoning_parser)
    started = int(time.time())

    # Each middleware added wraps the ones before: CORS, the outermost, answers preflights and labels every
    # answer, a 401 or a 413 included.
    app.add_middleware(BodyLimit, max_bytes=max_body_bytes, error_response=error_response)
    if api_key is not None:
        app.add_middleware(ApiKeyAuth, api_key=api_key, error_response=error_response)
    app.add_middleware(
        CORSMiddleware,
        allow_origins=allowed_origins if allowed_origins is not None else ["*"],
        allow_methods=["*"],
        allow_headers=["*"],
    )

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", []) if p != "body"]
        param = ".".join(loc) or None
        if first.get("type") == "json_invalid":
            return error_response(400, "request body is not valid JSON", None, "invalid_json")
        if first.get("type") == "extra_forbidden":
            return error_response(
                400, f"{param}: unknown field; this server does not take it", param, "invalid_request"
            )
        message = f"{param or 'body'}: {first.get('msg', 'invalid value')}"
        return error_response(400, message, param, "invalid_request")

    @app.exception_handler(InvalidParameter)
    async def on_invalid_parameter(request: Request, exc: InvalidParameter):
        return error_response(400, str(exc), exc.param, "invalid_request")

    @app.exception_handler(EngineDeadError)
    async def on_engine_dead(request: Request, exc: EngineDeadError):
        return error_response(503, str(exc))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def on_unexpected(request: Request, exc: Exception):
        return error_response(500, f"internal error: {type(exc).__name__}")

    def check_model(model: str | None) -> None:
        if model is not None and model != model_name:
            raise StarletteHTTPException(404, f"model={model!r} does not exist; this server serves {model_name!r}")

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=503 if llm.error is not None else 200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}  # vLLM's endpoint: clients probe it to tell the server's build

    model_card = {
        "id": model_name,
        "object": "model",
        "created": started,
        "owned_by": "pagellm",
        "max_model_len": llm.max_model_len,
    }

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_card]}

    @app.get("/v1/models/{model:path}")  # OpenAI's retrieve; a served name may hold slashes (org/name)
    async def model(model: str) -> dict:
        check_model(model)
        return model_card

    async def respond(job: Job, stream: bool, request: Request):
        if stream:
            return StreamingResponse(serving.stream(job), media_type="text/event-stream")
        result = await serving.run(job, lambda: client_gone(request))
        return Response(status_code=499) if result is None else result  # the client left

    # Tokenizing and rendering a chat template take seconds for megabytes of text: a worker thread does it (the
    # tokenizer releases the GIL), so the event loop keeps serving /health and every other stream meanwhile.
    @app.post("/v1/completions", responses=ERROR_RESPONSES)
    async def completions(body: CompletionRequest, request: Request):
        check_model(body.model)
        return await respond(await asyncio.to_thread(serving.completion_job, body), body.stream, request)

    @app.post("/v1/chat/completions", responses=ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        check_model(body.model)
        return await respond(await asyncio.to_thread(serving.chat_job, body), body.stream, request)

    @app.post("/tokenize", responses=ERROR_RESPONSES)
    async def tokenize(body: TokenizeRequest) -> dict:
        check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidParameter("prompt", "send exactly one of 'prompt' and 'messages'")
        if body.messages is not None:
            tokens = await asyncio.to_thread(
                serving.chat_prompt_ids, body.messages, body.add_generation_prompt, body.chat_template_kwargs
            )
        else:
            if llm.tokenizer is None:
                raise InvalidParameter("prompt", "prompt: this model has no tokenizer")
            tokens = await asyncio.to_thread(llm.tokenizer.encode, body.prompt, body.add_special_tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": llm.max_model_len}

    @app.post("/detokenize", responses=ERROR_RESPONSES)
    async def detokenize(body: DetokenizeRequest) -> dict:
        check_model(body.model)
        if llm.tokenizer is None:
            raise InvalidParameter("model", "this model has no tokenizer")
        vocab = llm.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise InvalidParameter("tokens", f"tokens: ids must be in [0, {vocab})")
        return {"prompt": await asyncio.to_thread(llm.tokenizer.decode, body.tokens, False)}

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(llm.stats), media_type="text/plain; version=0.0.4")

    @app.get("/stats")
    async def live_stats() -> dict:
        stats = llm.stats
        e = stats.engine
        return {
            "model": model_name,
            "running": e.num_running,
            "waiting": e.num_waiting,
            "kv_cache_usage": e.kv_cache_usage,
            "tokens_per_second": stats.tokens_per_second,
            "prefix_cache_hit_rate": e.prefix_cache_hit_rate,
            "num_preemptions": e.num_preemptions,
            "generation_tokens_total": e.generation_tokens_total,
            "max_model_len": llm.max_model_len,
            "api_key_required": api_key is not None,
        }

    @app.get("/")
    async def index() -> FileResponse:
        return FileResponse(STATIC / "index.html")

    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon() -> FileResponse:
        return FileResponse(STATIC / "favicon.svg", media_type="image/svg+xml")

    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    app.openapi = lambda: openapi_with_400s(app)
    return app


async def client_gone(request: Request) -> None:
    """Returns when the client hangs up. The body has been read by then, so the next ASGI message is the
    disconnect (the server sends it once the connection closes)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class ErrorBody(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | int | None


class ErrorResponseModel(BaseModel):
    error: ErrorBody


ERROR_RESPONSES: dict[int | str, dict] = {
    status: {"model": ErrorResponseModel, "description": name} for status, name in _ERROR_TYPES.items() if status != 500
}


def openapi_with_400s(app: FastAPI) -> dict:
    """The schema, with FastAPI's 422 for bad bodies left out: this server answers them with 400 (OpenAI's way)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        app.openapi_schema = schema
    return app.openapi_schema
