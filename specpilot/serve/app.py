"""`specpilot serve`: an OpenAI-compatible HTTP server (FastAPI on uvicorn, as vLLM's) on a build.

/v1/completions and /v1/chat/completions (plain and streamed as server-sent events), /v1/models,
/health and /metrics (Prometheus).  Errors are OpenAI's shape: 400 for a request that does not
validate (the field named), 404 for another model's name, 429 when the queue is full.  A client
that disconnects cancels its request: the engine stops at the next token and frees its row.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from specpilot.core.errors import SpecPilotError
from specpilot.serve import protocol
from specpilot.serve.chat import ChatTemplate
from specpilot.serve.scheduler import Job, Metrics, QueueFull, Scheduler

POLL_SECONDS = 0.25     # how often a waiting non-streamed request checks that its client is still there


class ServeError(Exception):
    def __init__(self, status: int, message: str, kind: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def _error_response(e: ServeError) -> JSONResponse:
    return JSONResponse(protocol.error(e.message, e.status, e.kind, e.param), status_code=e.status)


def _validation_message(e: RequestValidationError) -> tuple[str, str | None]:
    first = e.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON ({first.get('ctx', {}).get('error', first['msg'])})", None
    field = ".".join(loc) or None
    return (f"{field}: {first['msg']}" if field else first["msg"]), field


class Server:
    """The app's state: the system, its scheduler, the served name and the chat template."""

    def __init__(self, system, engine: str, model_name: str, chat_template: str | None, queue_size: int,
                 default_seed: int = 0):
        self.system, self.engine, self.model_name = system, engine, model_name
        self.chat = ChatTemplate(chat_template) if chat_template else None
        self.default_seed = default_seed
        self.metrics = Metrics()
        self.scheduler = Scheduler(system, engine, queue_size, self.metrics, system.tokenizer.decode)
        self.created = int(time.time())

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise ServeError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                             "NotFoundError", "model")

    def encode(self, prompt) -> list[int]:
        try:
            ids = list(prompt) if isinstance(prompt, list) else self.system.tokenizer.encode(prompt)
            self.system.check_prompt(ids)
        except SpecPilotError as e:
            raise ServeError(400, str(e), param="prompt") from None
        return ids

    def job(self, req, prompt: list[int], limit: int | None) -> Job:
        room = self.system.capacity - len(prompt)
        if room < 1:
            raise ServeError(400, f"the prompt has {len(prompt)} tokens; this model's context is "
                                  f"{self.system.capacity} tokens, leaving no room to generate", param="prompt")
        job = Job(prompt, min(limit or room, room), req.sampling(self.default_seed), req.stop,
                  asyncio.get_running_loop())
        try:
            self.scheduler.submit(job)
        except QueueFull:
            raise ServeError(429, "the server's queue is full; retry later", "RateLimitError") from None
        return job


async def _collect(job: Job, http: Request) -> tuple[str, list[int], str, dict]:
    """Wait for a non-streamed job's end; a client that leaves cancels it."""
    text, tokens = [], []
    while True:
        try:
            kind, payload, extra = await asyncio.wait_for(job.events.get(), POLL_SECONDS)
        except asyncio.TimeoutError:
            if await http.is_disconnected():
                job.cancelled.set()
                raise ServeError(499, "the client closed the request") from None
            continue
        if kind == "text":
            text.append(payload)
            tokens.extend(extra)
        elif kind == "error":
            raise ServeError(500, payload, "InternalServerError")
        else:
            return "".join(text), tokens, payload, extra


def _sse(body: dict | str) -> str:
    return f"data: {body if isinstance(body, str) else json.dumps(body)}\n\n"


async def _stream(job: Job, make_chunk):
    """Server-sent events of a job: a chunk per piece of text, the finish reason, [DONE].  Leaving
    this generator early (the client went away) cancels the job."""
    try:
        first = True
        while True:
            kind, payload, extra = await job.events.get()
            if kind == "text":
                yield _sse(make_chunk(payload, None, extra, first))
                first = False
            elif kind == "error":
                yield _sse(protocol.error(payload, 500, "InternalServerError"))
                return
            else:
                yield _sse(make_chunk("", payload, [], first))
                yield _sse("[DONE]")
                return
    finally:
        job.cancelled.set()


def create_app(server: Server) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_):
        yield
        server.scheduler.close()      # the engine thread ends with the app

    app = FastAPI(title="SpecPilot", docs_url=None, redoc_url=None, lifespan=lifespan)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, e: RequestValidationError):
        message, field = _validation_message(e)
        return _error_response(ServeError(400, message, param=field))

    @app.exception_handler(ServeError)
    async def refused(_, e: ServeError):
        return _error_response(e)

    _service_routes(app, server)
    _generation_routes(app, server)
    return app


def _service_routes(app: FastAPI, server: Server) -> None:
    """Health, metrics and the model list."""
    @app.get("/health")
    async def health():
        alive = server.scheduler.worker.is_alive()
        return JSONResponse({"status": "ok" if alive else "engine stopped"}, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def metrics():
        return PlainTextResponse(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "created": server.created,
                                            "owned_by": "specpilot", "max_model_len": server.system.capacity}]}


def _generation_routes(app: FastAPI, server: Server) -> None:
    """The OpenAI-compatible completions and chat completions, whole or streamed."""
    @app.post("/v1/completions")
    async def completions(req: protocol.CompletionRequest, http: Request):
        server.check_model(req.model)
        prompt = server.encode(req.prompt)
        job = server.job(req, prompt, req.max_tokens)
        rid = protocol.request_id("cmpl")
        if req.stream:
            def chunk(text, finish, tokens, first):
                return protocol.completion(rid, server.model_name, text, finish, tokens, len(prompt),
                                           req.return_token_ids, chunk=True)
            return StreamingResponse(_stream(job, chunk), media_type="text/event-stream")
        text, tokens, finish, _ = await _collect(job, http)
        return protocol.completion(rid, server.model_name, text, finish, tokens, len(prompt), req.return_token_ids)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: protocol.ChatCompletionRequest, http: Request):
        server.check_model(req.model)
        if server.chat is None:
            raise ServeError(400, f"{server.model_name} has no chat template; use /v1/completions or start the "
                                  "server with --chat-template FILE", param="messages")
        try:
            rendered = server.chat.render([m.model_dump() for m in req.messages])
        except SpecPilotError as e:
            raise ServeError(400, str(e), param="messages") from None
        prompt = server.encode(rendered)
        job = server.job(req, prompt, req.limit)
        rid = protocol.request_id("chatcmpl")
        if req.stream:
            def chunk(text, finish, tokens, first):
                return protocol.chat(rid, server.model_name, text, finish, tokens, len(prompt),
                                     req.return_token_ids, chunk=True, first=first)
            return StreamingResponse(_stream(job, chunk), media_type="text/event-stream")
        text, tokens, finish, _ = await _collect(job, http)
        return protocol.chat(rid, server.model_name, text, finish, tokens, len(prompt), req.return_token_ids)
