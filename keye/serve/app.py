"""The FastAPI application of ``keye serve``: OpenAI's ``/v1/chat/completions`` and ``/v1/models``.

A request is validated (:mod:`keye.serve.protocol`), its media fetched (:mod:`keye.serve.media`) and its
prompt processed on a worker thread, then queued on the :class:`~keye.serve.engine.BatchEngine`. Every
client mistake is a 4xx with an OpenAI-style JSON error naming the problem; a failure inside the server is
a 500 for that request only, and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import shutil
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from keye.demo.session import generated_tokens, sniff_media_kind
from keye.errors import KeyeError, KeyeInputError
from keye.serve.engine import BatchEngine, EngineConfig, Job, threadsafe_emitter
from keye.serve.errors import APIError
from keye.serve.media import MediaPolicy, fetch_media
from keye.serve.protocol import (
    ChatRequest,
    MediaRef,
    ServerLimits,
    message_fields,
    parse_chat_request,
    split_reasoning,
)

log = logging.getLogger(__name__)


@dataclass
class ServerConfig:
    """Everything ``keye serve`` can set besides the model: batching, limits and media policy."""

    model_name: str = "keye-tiny"
    engine: EngineConfig = field(default_factory=EngineConfig)
    limits: ServerLimits = field(default_factory=ServerLimits)
    media: MediaPolicy = field(default_factory=MediaPolicy)
    max_body_bytes: int = 48 * 1024 * 1024


class KeyeServer:
    """The model, processor and engine behind the HTTP routes (usable without HTTP in tests)."""

    def __init__(self, model: Any, processor: Any, config: ServerConfig | None = None):
        self.model = model
        self.processor = processor
        self.config = config or ServerConfig()
        tok = processor.tokenizer
        eos = list(getattr(model.config, "eos_token_ids", None) or [])
        for name in ("<|im_end|>", "<|endoftext|>"):
            tid = tok.convert_tokens_to_ids(name)
            if isinstance(tid, int) and tid >= 0 and tid not in eos:
                eos.append(tid)
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.convert_tokens_to_ids("<|endoftext|>")
        self.engine = BatchEngine(model, eos_token_ids=eos, pad_token_id=pad, config=self.config.engine)
        # The fast tokenizer and the processor's caches are not safe to share between threads.
        self._process_lock = threading.Lock()
        self.created = int(time.time())

    def close(self) -> None:
        """Stop the engine thread."""
        self.engine.close()

    # ---------------------------------------------------------------- preprocessing (worker threads)
    def prepare(self, req: ChatRequest) -> dict[str, Any]:
        """Fetch the media and run the processor; returns the single-row tensors. Raises APIError; a media
        item the processor cannot use is a 400 naming the request field and the file as the client gave it
        (its URL or path; never the server's temporary copy)."""
        workdir = Path(tempfile.mkdtemp(prefix="keye_serve_"))
        try:
            local: dict[str, MediaRef] = {}
            for ref in req.media:
                path = fetch_media(ref.url, ref.kind, ref.param, self.config.media, workdir)
                _check_kind(path, ref)
                req.messages[ref.message]["content"][ref.part][ref.kind] = str(path)
                local[str(path)] = ref
            with self._process_lock:
                try:
                    batch = self.processor(req.messages, mode=req.mode)
                except KeyeError as err:
                    raise _media_error(err, req, local, workdir) from None
            limit = self.config.limits.max_frames
            for meta in getattr(batch, "video_meta", []):
                if len(meta.indices) > limit:
                    raise APIError(400, f"a video was sampled to {len(meta.indices)} frames, the server allows "
                                   f"at most {limit}", code="too_many_frames")
            return {k: v for k, v in batch.items()}
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def stop_checker(self, req: ChatRequest):
        """``stop_check`` for the engine: True once the decoded text of a choice contains a stop string."""
        if not req.stop:
            return None
        tok = self.processor.tokenizer
        longest = max(len(s) for s in req.stop)

        def check(choice: int, ids: list[int]) -> bool:
            # Only the tail can hold a new match; decode a window of tokens long enough to contain it.
            tail = tok.decode(ids[-(longest + 8):], skip_special_tokens=True)
            return any(s in tail for s in req.stop)

        return check

    def decode(self, ids: list[int]) -> str:
        """Text of generated ids (special tokens dropped)."""
        return self.processor.tokenizer.decode(ids, skip_special_tokens=True)


def _strip_tmp(message: str, workdir: Path) -> str:
    # Downloaded media live in a temporary folder whose name means nothing to the client.
    return message.replace(str(workdir) + "/", "")


def client_name(url: str) -> str | None:
    """How the client named a media item, for error messages: its URL or local path as given, None for a
    ``data:`` URI (which has no name; the request field identifies it)."""
    url = url.strip()
    if url[:5].lower() == "data:":
        return None
    if url.startswith("file://"):
        from urllib.parse import unquote, urlparse

        return unquote(urlparse(url).path)
    return url if len(url) <= 200 else url[:197] + "..."


def _check_kind(path: Path, ref: MediaRef) -> None:
    """A 400 naming the client's file when its content is certainly the other kind of media than the part it
    came in (a PNG in a ``video_url`` part would otherwise be decoded as a one-frame video)."""
    sniffed = sniff_media_kind(path)
    if sniffed is not None and sniffed[0] != ref.kind:
        name = client_name(ref.url)
        what = f"{name} is" if name is not None else "it is"
        raise APIError(400, f"{ref.param}: {what} {'an image' if sniffed[0] == 'image' else 'a video'} "
                       f"({sniffed[1]}), not {'an image' if ref.kind == 'image' else 'a video'}; send it in "
                       f"{'an image_url' if sniffed[0] == 'image' else 'a video_url'} part", param=ref.param, code="invalid_media")


def _failing_media(err: KeyeError, req: ChatRequest, local: dict[str, MediaRef]) -> MediaRef | None:
    """The media item a processor error is about: the one whose file it names, else the one its item label
    ("video 1 (row 0)": the processor numbers each kind in prompt order, as ``req.media`` lists them)."""
    path = getattr(err, "path", None)
    if path is not None and path in local:
        return local[path]
    label = re.match(r"(video|image) (\d+)", str(getattr(err, "item", None) or ""))
    if label:
        same_kind = [ref for ref in req.media if ref.kind == label.group(1)]
        if int(label.group(2)) < len(same_kind):
            return same_kind[int(label.group(2))]
    return None


def _media_error(err: KeyeError, req: ChatRequest, local: dict[str, MediaRef], workdir: Path) -> APIError:
    """The 400 for a processor error on a request: ``<field>: <client's name for the file>: <reason>`` for a
    media item (:func:`_failing_media`), else ``messages: <reason>``. The processor's own item label ("video 0
    (row 0)") and the server's file names are left out."""
    ref = _failing_media(err, req, local)
    reason = err.reason if isinstance(err, KeyeInputError) else str(err)
    for where, item in local.items():  # decoder messages may quote the file they read
        name = client_name(item.url)
        reason = reason.replace(where, name if name is not None else "the data: URI")
    reason = _strip_tmp(reason, workdir)
    if ref is None:
        return APIError(400, f"messages: {reason}", param="messages", code="invalid_media" if req.media else None)
    name = client_name(ref.url)
    where = f"{name}: " if name is not None else ""
    return APIError(400, f"{ref.param}: {where}{reason}", param=ref.param, code="invalid_media")


def _cut_at_stop(text: str, stops: list[str]) -> tuple[str, bool]:
    hits = [text.find(s) for s in stops if s in text]
    return (text[: min(hits)], True) if hits else (text, False)


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def create_app(server: KeyeServer):
    """The FastAPI app serving ``server``."""
    app = FastAPI(title="keye serve", version="1")
    cfg = server.config

    @app.exception_handler(APIError)
    async def _api_error(_request: Request, err: APIError):
        return _error_response(err)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, err: StarletteHTTPException):
        return _error_response(APIError(err.status_code, str(err.detail)))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, err: RequestValidationError):
        return _error_response(APIError(400, f"invalid request: {err.errors()}"))

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, err: Exception):
        log.exception("unexpected error while serving a request")
        return _error_response(APIError(500, f"internal error: {type(err).__name__}: {err}"))

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": cfg.model_name, "engine": server.engine.stats}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": cfg.model_name, "object": "model", "created": server.created,
                                            "owned_by": "keye"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        raw = await _read_body(request, cfg.max_body_bytes)
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise APIError(400, f"the request body is not valid JSON ({err})") from None
        req = parse_chat_request(body, cfg.limits)
        if req.model is not None and req.model != cfg.model_name:
            raise APIError(404, f"model {req.model!r} is not served here; this server serves {cfg.model_name!r}",
                           param="model", code="model_not_found")
        inputs = await run_in_threadpool(server.prepare, req)
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        job = Job(inputs=inputs, n=req.n, max_tokens=req.max_tokens, do_sample=req.do_sample,
                  temperature=req.temperature, top_p=req.top_p, seed=req.seed,
                  emit=threadsafe_emitter(loop, events), stop_check=server.stop_checker(req))
        server.engine.submit(job)
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        created = int(time.time())
        if req.stream:
            return StreamingResponse(_stream(server, req, job, events, rid, created), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        choices: dict[int, dict[str, Any]] = {}
        while True:
            ev = await events.get()
            if ev["type"] == "error":
                raise ev["error"]
            if ev["type"] == "done":
                text, stopped = _cut_at_stop(server.decode(ev["tokens"]), req.stop)
                choices[ev["choice"]] = {
                    "index": ev["choice"], "message": message_fields(text),
                    "finish_reason": "stop" if stopped else ev["reason"], "logprobs": None,
                    "_tokens": generated_tokens(len(ev["tokens"]), ev["eos"]),
                }
            elif ev["type"] == "end":
                break
        completion = sum(c.pop("_tokens") for c in choices.values())
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": created, "model": cfg.model_name,
            "choices": [choices[i] for i in sorted(choices)],
            "usage": {"prompt_tokens": job.prompt_tokens, "completion_tokens": completion,
                      "total_tokens": job.prompt_tokens + completion},
        })

    return app


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, or a 413 when it is larger than ``limit`` bytes.

    The excess is read and dropped (up to 8x the limit) before answering, because a client still sending
    its body cannot read a response and would see a broken connection instead of the 413.
    """
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size <= limit:
            chunks.append(chunk)
        elif size > 8 * limit:
            break
    if size > limit:
        raise APIError(413, f"the request body is larger than the server's limit of {limit} bytes",
                       code="request_too_large")
    return b"".join(chunks)


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


async def _stream(server: KeyeServer, req: ChatRequest, job: Job, events: asyncio.Queue, rid: str, created: int):
    """Server-sent events of one request: a role chunk per choice, content / reasoning deltas, a final chunk
    with the finish reason per choice, the usage chunk when asked for, then ``[DONE]``."""
    name = server.config.model_name

    def chunk(choices: list[dict[str, Any]], usage: dict | None = None) -> str:
        body: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": name,
                                "choices": choices}
        if req.include_usage:
            body["usage"] = usage
        return _sse(body)

    ids: dict[int, list[int]] = {c: [] for c in range(req.n)}
    sent: dict[int, tuple[int, int]] = {c: (0, 0) for c in range(req.n)}  # chars of (reasoning, content) sent
    finished: set[int] = set()
    hold = max((len(s) for s in req.stop), default=1) - 1
    for c in range(req.n):
        yield chunk([{"index": c, "delta": {"role": "assistant", "content": ""}, "finish_reason": None, "logprobs": None}])

    def delta(c: int, final: bool) -> dict[str, Any] | None:
        text = server.decode(ids[c])
        text, stopped = _cut_at_stop(text, req.stop)
        if not final and not stopped:
            if text.endswith("\ufffd"):
                return None  # an incomplete multi-byte character: wait for the next token
            if hold:
                text = text[: max(len(text) - hold, 0)]  # a stop string may still be forming at the end
        reasoning, content = split_reasoning(text, final=final or stopped)
        r0, c0 = sent[c]
        out: dict[str, Any] = {}
        if len(reasoning) > r0:
            out["reasoning_content"] = reasoning[r0:]
        if len(content) > c0:
            out["content"] = content[c0:]
        sent[c] = (max(r0, len(reasoning)), max(c0, len(content)))
        return out or None

    completion = 0
    while True:
        ev = await events.get()
        kind = ev["type"]
        if kind == "error":
            err: APIError = ev["error"]
            yield _sse(err.body())
            break
        if kind == "token":
            c = ev["choice"]
            ids[c].append(ev["token"])
            d = delta(c, final=False)
            if d:
                yield chunk([{"index": c, "delta": d, "finish_reason": None, "logprobs": None}])
        elif kind == "done":
            c = ev["choice"]
            ids[c] = list(ev["tokens"])
            completion += generated_tokens(len(ev["tokens"]), ev["eos"])
            d = delta(c, final=True) or {}
            _, stopped = _cut_at_stop(server.decode(ids[c]), req.stop)
            finished.add(c)
            yield chunk([{"index": c, "delta": d, "finish_reason": "stop" if stopped else ev["reason"],
                          "logprobs": None}])
        elif kind == "end":
            if req.include_usage:
                yield chunk([], {"prompt_tokens": job.prompt_tokens, "completion_tokens": completion,
                                 "total_tokens": job.prompt_tokens + completion})
            break
    yield "data: [DONE]\n\n"


def serve(server: KeyeServer, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info",
          sock: Any = None) -> None:
    """Run the HTTP server until interrupted (blocking). ``sock``: an already bound listening socket to serve
    on (``keye serve`` binds its port before loading the model, so a busy port is reported at once);
    without it uvicorn binds ``host:port`` itself."""
    import uvicorn

    try:
        uv = uvicorn.Server(uvicorn.Config(create_app(server), host=host, port=port, log_level=log_level))
        uv.run(sockets=[sock] if sock is not None else None)
    finally:
        server.close()


class BackgroundServer:
    """``server`` behind uvicorn on a loopback port, on a daemon thread (tests, benchmarks, notebooks).

    Use as a context manager: ``with BackgroundServer(server) as bg: OpenAI(base_url=bg.url, ...)``. Leaving
    the block stops uvicorn and the engine.
    """

    def __init__(self, server: KeyeServer, host: str = "127.0.0.1", port: int = 0, startup_timeout: float = 60.0):
        import socket

        import uvicorn

        if port == 0:
            with socket.socket() as s:
                s.bind((host, 0))
                port = s.getsockname()[1]
        self.server = server
        self.port = port
        self.url = f"http://{host}:{port}/v1"
        self.startup_timeout = startup_timeout
        self._uv = uvicorn.Server(uvicorn.Config(create_app(server), host=host, port=port, log_level="warning"))
        self._thread = threading.Thread(target=self._uv.run, name="keye-serve-http", daemon=True)

    def __enter__(self) -> BackgroundServer:
        self._thread.start()
        deadline = time.monotonic() + self.startup_timeout
        while not self._uv.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError(f"keye serve did not start on port {self.port}")
            time.sleep(0.05)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._uv.should_exit = True
        self._thread.join(10)
        self.server.close()
