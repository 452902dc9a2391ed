"""The FastAPI app: OpenAI routes over one engine. `create_app(engine, ...)` takes any AsyncEngine-like object."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from ds4.engine.structured_output import GrammarCache
from ds4.serve import chat, completions
from ds4.serve.body import parse_body
from ds4.serve.chat_encoding import ChatFormatError, encode_chat_request
from ds4.serve.errors import APIError, bad_request
from ds4.serve.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from ds4.serve.sampling import sse
from ds4.serve.state import ServerState

logger = logging.getLogger(__name__)

_OPEN_PATHS = ("/health", "/metrics")
_ENDPOINTS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/models",
    "/health",
    "/metrics",
    "/tokenize",
    "/detokenize",
    "/tokenizer_info",
)
# Larger request bodies get 413: a whole max-length prompt as token ids is a few MB.
DEFAULT_MAX_BODY_BYTES = 64 << 20
# How often a non-streaming request checks whether its client is still there.
_DISCONNECT_POLL_S = 0.25


def create_app(
    engine,
    *,
    served_model_names: list[str] | str = "ds4",
    api_key: str | None = None,
    grammar_cache: GrammarCache | None = None,
    drain_timeout_s: float = 30.0,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> FastAPI:
    """`engine`: an AsyncEngine. `grammar_cache`: share one across apps (tests); by default the app builds its own."""
    names = [served_model_names] if isinstance(served_model_names, str) else list(served_model_names)
    state = ServerState(engine, names, api_key, grammar_cache)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        if not await state.drain(drain_timeout_s):
            logger.warning("shutting down with %d requests still running", state.active_requests)
        await engine.shutdown()
        if grammar_cache is None:
            state.grammars.close()

    app = FastAPI(title="ds4", lifespan=lifespan)
    app.state.ds4 = state

    app.add_middleware(_Guard, state=state)

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return error.response()

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):  # unknown path, wrong method
        return APIError(error.status_code, str(error.detail)).response()

    async def _parse(request: Request, model):
        return await parse_body(request, model, max_body_bytes)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await _parse(request, ChatCompletionRequest)
        state.check_model(body.model)
        turn = chat.ChatTurn(state, body)
        await turn.attach_grammar(state)
        request_id, outputs = await state.generate("chatcmpl", turn.choices)
        if body.stream:
            return _stream(chat.stream_response(state, turn, request_id, outputs), outputs)
        return JSONResponse(
            await _unless_disconnected(request, chat.full_response(state, turn, request_id, outputs), outputs)
        )

    @app.post("/v1/completions")
    async def text_completions(request: Request):
        body = await _parse(request, CompletionRequest)
        state.check_model(body.model)
        turn = completions.CompletionTurn(state, body)
        request_id, outputs = await state.generate("cmpl", turn.choices)
        if body.stream:
            return _stream(completions.stream_response(state, turn, request_id, outputs), outputs)
        return JSONResponse(
            await _unless_disconnected(request, completions.full_response(state, turn, request_id, outputs), outputs)
        )

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": state.created,
                    "owned_by": "ds4",
                    "max_model_len": state.max_model_len,
                }
                for name in state.served_model_names
            ],
        }

    @app.get("/health")
    async def health():
        if engine.error is not None:
            raise APIError(503, f"the engine stopped: {engine.error}")
        if state.shutting_down:
            raise APIError(503, "the server is shutting down")
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await _parse(request, TokenizeRequest)
        state.check_model(body.model)
        if body.messages is not None:
            tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []] or None
            try:
                text = encode_chat_request(body.messages, tools, body.chat_template_kwargs, body.reasoning_effort).text
            except ChatFormatError as e:
                raise bad_request(str(e), param="messages") from e
            tokens = state.tokenizer.encode(text)
        else:
            tokens = state.tokenizer.encode(body.prompt)
            if body.add_special_tokens:
                tokens = completions.prompt_token_ids(state, tokens)
        result = {"tokens": tokens, "count": len(tokens), "max_model_len": state.max_model_len}
        if body.return_token_strs:
            result["token_strs"] = [state.tokenizer.id_to_token(t) for t in tokens]
        return result

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await _parse(request, DetokenizeRequest)
        state.check_model(body.model)
        vocab = state.tokenizer.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token ids outside the vocabulary of {vocab}: {bad[:8]}", param="tokens")
        return {"prompt": state.tokenizer.decode(body.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        """What clients that tokenize through the server (lm-eval's remote tokenizer) need to know."""
        special = state.tokenizer.special
        return {
            "tokenizer_class": "DSV4Tokenizer",
            "bos_token": state.tokenizer.backend.id_to_token(special.bos),
            "eos_token": state.tokenizer.backend.id_to_token(special.eos),
            "model_max_length": state.max_model_len,
            "vocab_size": state.vocab_size,
        }

    return app


class _Guard:
    """Plain ASGI middleware (Starlette's BaseHTTPMiddleware would hide client disconnects from the handlers):
    checks the API key, counts responses by endpoint and status, and turns an error that escaped a handler
    into a 500 logged once here (Starlette's own last resort would log it twice and re-raise)."""

    def __init__(self, app, state: ServerState):
        self.app = app
        self.state = state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        label = path if path in _ENDPOINTS else "other"
        started = False

        async def counting_send(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                self.state.metrics.requests.labels(label, str(message["status"])).inc()
            await send(message)

        key = self.state.api_key
        if key and path not in _OPEN_PATHS and _authorization(scope) != f"Bearer {key}":
            response = APIError(
                401, "invalid or missing API key (send `Authorization: Bearer <key>`)", code="invalid_api_key"
            ).response()
            return await response(scope, receive, counting_send)
        try:
            await self.app(scope, receive, counting_send)
        except Exception as error:
            logger.exception("unhandled error on %s", path)
            if not started:
                response = APIError(500, f"internal error: {type(error).__name__}: {error}").response()
                await response(scope, receive, counting_send)
            else:  # the response is under way: end it cleanly rather than drop the connection
                await send({"type": "http.response.body", "body": b"", "more_body": False})


def _authorization(scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            return value.decode("latin-1")
    return None


def _stream(chunks: AsyncIterator[str], outputs) -> StreamingResponse:
    async def body():
        try:
            async for chunk in chunks:
                yield chunk
        except Exception as error:  # the headers are out: report in the stream, end it properly
            logger.exception("stream failed")
            yield sse(APIError(500, f"internal error: {type(error).__name__}: {error}").body())
            yield "data: [DONE]\n\n"
        finally:  # also when the client went away: closing the outputs aborts the request
            await outputs.aclose()

    return StreamingResponse(
        body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )


async def _unless_disconnected(request: Request, response, outputs) -> dict:
    """Build a non-streaming response, abandoning (and aborting) it if the client disconnects first."""
    task = asyncio.ensure_future(response)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                task.cancel()
                raise APIError(499, "the client disconnected")
    finally:
        if not task.done():
            task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await outputs.aclose()
