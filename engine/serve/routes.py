"""The endpoints: /v1/models, /v1/completions, /v1/chat/completions, /health, /metrics,
/v1/kvscope/snapshot, /v1/kvscope/stream. Requests go to the shared EngineThread tagged
origin="http"; a client that goes away mid-request has its requests aborted (blocks freed)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import threading
import time
import uuid

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from engine.core.inputs import MAX_PROMPT_CHARS, chat_ids, check_unicode, text_prompt_ids
from engine.core.thread import EngineCrashed
from engine.serve import render
from engine.serve.bridge import Submitter, Waker
from engine.serve.errors import APIError, param_of
from engine.serve.metrics import CONTENT_TYPE, served_max_model_len
from engine.serve.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from engine.serve.tools import (
    ToolCallStream,
    finish_reason_with_calls,
    parse_tool_calls,
    template_supports_tools,
    tool_call_delta,
)

router = APIRouter()
DISCONNECT_POLL_S = 0.5
IGNORED_HEADER = "x-kvscope-ignored-fields"
log = logging.getLogger("kvscope.serve")


def _ignored_headers(body) -> dict:
    """Fields the request carried that this server does not use: logged (as vLLM logs them) and
    listed, comma-separated, in the x-kvscope-ignored-fields response header."""
    ignored = body.ignored_fields()
    if not ignored:
        return {}
    log.warning("The following fields were present in the request but ignored: %s", ", ".join(ignored))
    value = ",".join(ignored)
    return {IGNORED_HEADER: value if len(value) <= 2000 else value[:2000] + "..."}


def _state(request: Request):
    return request.app.state.kvscope


# ------------------------------------------------------------------ plain routes
@router.get("/health")
async def health(request: Request):
    st = _state(request)
    if not st.thread.healthy:
        raise APIError(503, f"engine is down: {st.thread.error or 'not running'}")
    return Response(status_code=200)


@router.get("/v1/models")
async def models(request: Request):
    st = _state(request)
    return {"object": "list", "data": [_model_card(st)]}


def _model_card(st) -> dict:
    cfg = st.thread.config
    return {
        "id": st.model_name,
        "object": "model",
        "created": st.created,
        "owned_by": "kvscope",
        "root": cfg.model,
        "parent": None,
        "max_model_len": served_max_model_len(st.thread),
        "permission": [],
    }


@router.get("/v1/models/{model_id:path}")
async def model_by_id(request: Request, model_id: str):
    st = _state(request)
    _check_model(st, model_id)
    return _model_card(st)


@router.get("/version")
async def version():
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as pkg_version

    try:
        v = pkg_version("kvscope")
    except PackageNotFoundError:
        v = "0.0.0"
    return {"version": v}


@router.api_route("/ping", methods=["GET", "POST"])
async def ping(request: Request):
    return await health(request)


@router.post("/tokenize")
async def tokenize(request: Request, body: TokenizeRequest):
    """vLLM's /tokenize: a prompt (add_special_tokens) or chat messages (the chat template)."""
    st = _state(request)
    th = st.thread
    _check_model(st, body.model)
    try:
        if body.messages is not None:
            with _TOK_LOCK:
                ids = chat_ids(th.tokenizer, body.chat_messages(), add_generation_prompt=body.add_generation_prompt)
        else:
            check_unicode(body.prompt)
            with _TOK_LOCK:
                ids = list(th.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens))
    except ValueError as e:
        raise APIError(
            400, str(e), param_of(str(e)) or ("messages" if body.messages is not None else "prompt")
        ) from None
    strs = th.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return {"count": len(ids), "max_model_len": served_max_model_len(th), "tokens": ids, "token_strs": strs}


@router.post("/detokenize")
async def detokenize(request: Request, body: DetokenizeRequest):
    st = _state(request)
    th = st.thread
    _check_model(st, body.model)
    vocab = len(th.tokenizer)
    bad = [t for t in body.tokens if t >= vocab]
    if bad:
        raise APIError(400, f"tokens: token id {bad[0]} is outside the vocabulary (size {vocab})", "tokens")
    with _TOK_LOCK:
        text = th.tokenizer.decode(body.tokens)
    return {"prompt": text}


@router.get("/metrics")
async def metrics(request: Request):
    body = await asyncio.to_thread(_state(request).metrics.render)
    return Response(body, media_type=CONTENT_TYPE)


@router.get("/v1/kvscope/snapshot")
async def snapshot(request: Request):
    snap = await asyncio.to_thread(_state(request).thread.snapshot_now)
    return JSONResponse(snap.to_dict())


@router.get("/v1/kvscope/stream")
async def stream_snapshots(
    request: Request,
    since: int = Query(0, ge=0),
    interval: float | None = Query(None),
    max_events: int = Query(5000, ge=0, le=100_000),
):
    """SSE: every `interval` seconds (default the server's, 0.25 s; bounded to [0.05, 10]) one
    `data:` line {"snapshot": Snapshot.to_dict(), "events": [Event.to_dict(), ...]} with the
    events after `since` (an event seq), when anything changed; a comment line keeps it alive."""
    st = _state(request)
    every = st.stream_interval_s if interval is None else interval
    if not 0.05 <= every <= 10:
        raise APIError(400, f"interval must be in [0.05, 10] seconds, got {every}", "interval")

    async def gen():
        last_seq, last_snap, idle = since, None, 0.0
        while True:
            if await request.is_disconnected():
                return
            th = st.thread
            snap = th.snapshot()
            evs = [e for e in th.events.since(last_seq)][:max_events] if max_events else []
            if snap is not last_snap or evs:
                if evs:
                    last_seq = evs[-1].seq
                last_snap, idle = snap, 0.0
                payload = {"snapshot": snap.to_dict(), "events": [e.to_dict() for e in evs]}
                yield f"data: {json.dumps(payload)}\n\n"
            else:
                idle += every
                if idle >= 10:
                    idle = 0.0
                    yield ": keepalive\n\n"
            await asyncio.sleep(every)

    return StreamingResponse(gen(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


# ------------------------------------------------------------------ generation
def _bridge(st, loop):
    """The server loop's Waker and Submitter (made on first use in that loop)."""
    b = getattr(st, "bridge", None)
    if b is None or b[0].loop is not loop or b[1].thread is not st.thread:
        b = st.bridge = (Waker(loop), Submitter(st.thread, loop))
    return b


class _Run:
    """One HTTP generation request: its engine requests (n choices x prompts) and an asyncio
    event the engine thread sets (through the Waker) after each update of any of them."""

    def __init__(self, st, loop: asyncio.AbstractEventLoop):
        self.st, self.loop = st, loop
        self.event = asyncio.Event()
        self.handles: list = []
        self.prompt_lens: list[int] = []
        self.waker, self.submitter = _bridge(st, loop)

    def notify(self) -> None:
        self.waker.notify(self)

    async def submit_choice(self, prompt, params):
        """Submits one engine request of this HTTP run (id http-…, origin "http", woken through
        the Waker), batched with its companions by the Submitter. Returns the handle;
        ValueError -> 400, EngineCrashed -> 503 (raised by the caller's handler)."""
        return await self.submitter.submit_batched(
            prompt, params, request_id=f"http-{uuid.uuid4().hex[:12]}", origin="http", listener=self.notify
        )

    def abort_unfinished(self) -> None:
        for h in self.handles:
            if not h.finished:
                self.st.thread.abort(h.request_id)


def _check_model(st, name: str | None) -> None:
    if name is not None and name not in st.aliases:
        raise APIError(404, f"The model `{name}` does not exist (served: {st.model_name!r}).", "model")


def _check_capacity(st, n_new: int) -> None:
    th = st.thread
    if not th.healthy:
        raise APIError(503, f"engine is down: {th.error or 'not running'}")
    waiting = th.snapshot().metrics.num_waiting
    if waiting + st.in_flight + n_new > st.max_waiting + th.config.max_num_seqs:
        raise APIError(
            429,
            f"server is at capacity: {waiting} requests waiting, {st.in_flight} in flight, the "
            f"limit is {st.max_waiting} queued (--max-waiting); retry later",
        )


_TOK_LOCK = threading.Lock()  # the server's own tokenizer calls, one at a time (never the engine lock)


def _tokenize(th, prompt) -> list[int]:
    """Text -> ids with the engine's tokenizer; token ids pass through (the engine checks them
    against the vocabulary)."""
    if isinstance(prompt, str):
        with _TOK_LOCK:
            return text_prompt_ids(th.tokenizer, prompt)
    return list(prompt)


def _chat_ids(th, req: ChatCompletionRequest) -> list[int]:
    msgs = req.chat_messages()
    total = sum(len(m["content"]) for m in msgs)
    if total > MAX_PROMPT_CHARS:
        raise ValueError(f"messages hold {total} characters; the limit is {MAX_PROMPT_CHARS}")
    for m in msgs:
        try:
            m["content"].encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError("messages: content is not valid Unicode text (a lone surrogate)") from None
    tools = req.tool_defs()
    if tools and not template_supports_tools(th.tokenizer):
        raise ValueError("tools: this model's chat template does not support tools (it never reads `tools`)")
    with _TOK_LOCK:
        return chat_ids(th.tokenizer, msgs, tools=tools, add_generation_prompt=req.add_generation_prompt)


def _max_tokens(th, requested: int | None, prompt_len: int, tier: str | None = None) -> int:
    if requested is not None:
        return requested
    return th.engine.max_completion_tokens(prompt_len, tier)  # the rest of the context, pool and tier


def _choice_params(params, j: int):
    """Choice j of n: its own seed (seed + j, vLLM's per-child seed), else the same params."""
    if params.seed is None:
        return params
    return dataclasses.replace(params, seed=(params.seed + j) % (2**63))


async def _start(st, prompts_ids: list[list[int]], body, logprobs: int | None, loop) -> _Run:
    run = _Run(st, loop)
    th = st.thread
    n = body.n
    _check_capacity(st, n * len(prompts_ids))
    st.in_flight += n * len(prompts_ids)
    run.counted = n * len(prompts_ids)
    try:
        for ids in prompts_ids:
            run.prompt_lens.append(len(ids))
            limit = getattr(body, "max_completion_tokens", None) or body.max_tokens
            params = body.sampling_params(_max_tokens(th, limit, len(ids), body.tier), logprobs)
            first = await run.submit_choice(ids, params)
            run.handles.append(first)
            if n > 1:
                # n > 1 forks the prompt's blocks: the rest start once the first has prefilled and
                # its full blocks are in the prefix cache, so they share them (ref count n)
                while first.output is None and not first.finished:
                    run.event.clear()
                    try:
                        await asyncio.wait_for(run.event.wait(), DISCONNECT_POLL_S)
                    except TimeoutError:
                        pass
                for j in range(1, n):
                    run.handles.append(await run.submit_choice(ids, _choice_params(params, j)))
    except ValueError as e:
        run.abort_unfinished()
        st.in_flight -= run.counted
        raise APIError(400, str(e), param_of(str(e))) from None
    except EngineCrashed as e:
        run.abort_unfinished()
        st.in_flight -= run.counted
        raise APIError(503, f"engine is down: {e}") from None
    except BaseException:
        run.abort_unfinished()
        st.in_flight -= run.counted
        raise
    return run


# the same prompt handling for vLLM's render routes (engine/serve/vllm_routes.py)
chat_prompt_ids = _chat_ids
completion_prompt_ids = _tokenize
check_model = _check_model


def _finish_run(st, run: _Run) -> None:
    run.abort_unfinished()
    st.in_flight -= run.counted
    run.counted = 0


def _raise_if_failed(h) -> None:
    """The engine could not finish the request: 503 when it is down, shutting down or being
    reconfigured (retry later), 500 when a step failed for this request (e.g. non-finite logits)."""
    if h.error and (h.output is None or h.output.outputs[0].finish_reason == "error" or not h.output.finished):
        step_failed = h.output is not None and h.output.outputs[0].finish_reason == "error" and h.owner.healthy
        raise APIError(500 if step_failed else 503, f"generation failed: {h.error}")


async def _wait_all(request: Request, run: _Run) -> None:
    while not all(h.finished for h in run.handles):
        run.event.clear()
        if all(h.finished for h in run.handles):
            break
        try:
            await asyncio.wait_for(run.event.wait(), DISCONNECT_POLL_S)
        except TimeoutError:
            if await request.is_disconnected():
                raise asyncio.CancelledError() from None


async def _generate(request: Request, body, chat: bool):
    st = _state(request)
    th = st.thread
    _check_model(st, body.model)
    if not th.healthy:
        raise APIError(503, f"engine is down: {th.error or 'not running'}")
    try:
        if chat:
            prompts_ids = [await asyncio.to_thread(_chat_ids, th, body)]
            logprobs = (body.top_logprobs or 0) if body.logprobs else None
        else:
            prompts_ids = [await asyncio.to_thread(_tokenize, th, p) for p in body.prompts()]
            logprobs = body.logprobs
    except ValueError as e:
        raise APIError(400, str(e), param_of(str(e)) or ("messages" if chat else "prompt")) from None
    loop = asyncio.get_running_loop()
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    created = int(time.time())
    run = await _start(st, prompts_ids, body, logprobs, loop)
    extra_headers = _ignored_headers(body)
    if body.stream:
        return StreamingResponse(
            _stream(request, st, run, body, chat, rid, created),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", **extra_headers},
        )
    try:
        await _wait_all(request, run)
    finally:
        _finish_run(st, run)
    for h in run.handles:
        _raise_if_failed(h)
    choices = []
    for i, h in enumerate(run.handles):
        out = h.output
        c = out.outputs[0]
        if chat:
            content, calls = parse_tool_calls(c.text) if body.parses_tool_calls else (c.text, [])
            choices.append(
                {
                    "index": i,
                    "message": {"role": "assistant", "content": content, "tool_calls": calls},
                    "logprobs": render.chat_logprobs(th, c, 0, len(c.token_ids)),
                    "finish_reason": finish_reason_with_calls(render.finish_reason(out), bool(calls)),
                    "stop_reason": render.stop_reason(out),
                }
            )
        else:
            text = c.text
            prefix = ""
            if body.echo:
                prefix = out.prompt or th.engine.decode(out.prompt_token_ids)
            choices.append(
                {
                    "index": i,
                    "text": prefix + text,
                    "logprobs": render.completion_logprobs(th, c, 0, len(c.token_ids), len(prefix)),
                    "finish_reason": render.finish_reason(out),
                    "stop_reason": render.stop_reason(out),
                }
            )
    result = {
        "id": rid,
        "object": "chat.completion" if chat else "text_completion",
        "created": created,
        "model": st.model_name,
        "choices": choices,
        "usage": render.usage(run, body.n),
    }
    return JSONResponse(result, headers=extra_headers)


async def _stream(request: Request, st, run: _Run, body, chat: bool, rid: str, created: int):
    th = st.thread
    obj = "chat.completion.chunk" if chat else "text_completion"
    usage_on = body.include_usage
    continuous = bool(body.stream_options and body.stream_options.continuous_usage_stats and usage_on)
    cursors = [
        render.Delta(body.stop if isinstance(body.stop, list) else ([body.stop] if body.stop else None))
        for _ in run.handles
    ]
    done = [False] * len(run.handles)
    offsets = [0] * len(run.handles)
    tool_streams = [ToolCallStream() for _ in run.handles] if chat and body.parses_tool_calls else None
    opts = body.stream_opts  # the packet-size defences: padding (render.sse_event), coalescing

    def chunk(choices, usage="absent", content=""):
        d = {"id": rid, "object": obj, "created": created, "model": st.model_name, "choices": choices}
        if usage != "absent":
            d["usage"] = usage
        elif continuous:
            d["usage"] = render.usage(run, body.n)  # tokens so far, on every chunk (vLLM's continuous_usage_stats)
        elif usage_on:
            d["usage"] = None
        if not choices:  # the closing usage chunk carries counts only: not padded
            return f"data: {json.dumps(d)}\n\n"
        return render.sse_event(d, len(json.dumps(content)), opts.include_obfuscation, opts.pad_chunks_to)

    try:
        if chat:
            yield chunk(
                [
                    {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                    for i in range(len(run.handles))
                ]
            )
        while not all(done):
            run.event.clear()
            for i, h in enumerate(run.handles):
                if done[i] or h.output is None and not h.finished:
                    continue
                if h.error and (
                    h.output is None or not h.output.finished or h.output.outputs[0].finish_reason == "error"
                ):
                    err = {
                        "error": {
                            "message": f"generation failed: {h.error}",
                            "type": "InternalServerError",
                            "param": None,
                            "code": 500,
                        }
                    }
                    yield f"data: {json.dumps(err)}\n\n"
                    done[i] = True
                    continue
                out = h.output
                if opts.coalesce_tokens > 1 and not out.finished:
                    if len(out.outputs[0].token_ids) - cursors[i].tokens_sent < opts.coalesce_tokens:
                        continue  # coalescing: wait until enough tokens for one chunk
                text, toks, first = cursors[i].take(out)
                finished = out.finished
                if not text and not toks and not finished:
                    continue
                c = out.outputs[0]
                fr = render.finish_reason(out) if finished else None
                if chat:
                    delta = {"content": text} if text or not finished else {}
                    if tool_streams is not None:  # content up to a possible <tool_call>; each call once closed
                        ts = tool_streams[i]
                        text, calls = ts.feed(c.text[: cursors[i].text_sent], finished)
                        delta = {"content": text} if text else {}
                        if calls:
                            delta["tool_calls"] = [tool_call_delta(k, call) for k, call in calls]
                        fr = finish_reason_with_calls(fr, bool(ts.calls))
                        if not delta and not finished and c.logprobs is None:
                            continue  # held back: it may be the start of a call
                    ch = {
                        "index": i,
                        "delta": delta,
                        "logprobs": render.chat_logprobs(th, c, first, len(toks)) if toks else None,
                        "finish_reason": fr,
                    }
                else:
                    ch = {
                        "index": i,
                        "text": text,
                        "logprobs": render.completion_logprobs(th, c, first, len(toks), offsets[i]) if toks else None,
                        "finish_reason": fr,
                    }
                    offsets[i] += len(text)
                if finished:
                    ch["stop_reason"] = render.stop_reason(out)
                    done[i] = True
                yield chunk([ch], content=ch.get("delta", ch.get("text")))
            if all(done):
                break
            try:
                await asyncio.wait_for(run.event.wait(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    return
        if usage_on:
            yield chunk([], render.usage(run, body.n))
        yield "data: [DONE]\n\n"
    finally:
        _finish_run(st, run)  # aborts whatever did not finish: a client that left frees its blocks


@router.post("/v1/completions")
async def completions(request: Request, body: CompletionRequest):
    return await _generate(request, body, chat=False)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request, body: ChatCompletionRequest):
    return await _generate(request, body, chat=True)
