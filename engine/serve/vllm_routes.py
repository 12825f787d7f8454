"""vLLM's routes for gateways and routers, in vLLM's shapes, so vllm-router and other tools that
front vLLM use kvscope unchanged:

- POST /v1/chat/completions/render and POST /v1/completions/render: the request as the engine
  would run it, without running it. vLLM answers with its `GenerateRequest` (one object for chat,
  a list, one per prompt, for completions): request_id, token_ids (the prompt after the chat
  template / tokenizer), features (null: text only), sampling_params, model, stream,
  stream_options, cache_salt, priority. A router takes token_ids to score each engine's cached
  prefix. Bad input is a 400 naming the field, as on the generation routes (the same checks, the
  same tokenization, the same default max_tokens).
- GET /get_server_info: vLLM's fields (model_path, model_id, served_model_name, dp_size,
  tp_size) plus what a KV-aware router reads to index the events: kv_block_size and instance_id
  (`app.state.kvscope_instance_id` when set, else kvscope-<12 hex> drawn once per app), and the
  prefix-cache hashing (prefix_caching_hash_algo, and the NONE_HASH seed).
- GET /kv_event_sources: vLLM's discovery map, keyed by data-parallel rank (as a string), each
  entry the KV-events config of that rank's publisher (enable_kv_cache_events, publisher "zmq",
  endpoint, replay_endpoint, topic, buffer_steps, hwm, and encoding "msgpack" / schema_version 1,
  without which vllm-router 0.1.17 ignores the entry: measured); {} when the server publishes no
  events.
"""

from __future__ import annotations

import asyncio
import uuid

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from engine.core.inputs import prompt_ids
from engine.core.thread import EngineCrashed
from engine.serve.errors import APIError, param_of
from engine.serve.metrics import served_max_model_len
from engine.serve.protocol import ChatCompletionRequest, CompletionRequest
from engine.serve.routes import chat_prompt_ids, check_model, completion_prompt_ids

router = APIRouter()


def _state(request: Request):
    return request.app.state.kvscope


def instance_id(app) -> str:
    """This server's id for routers: app.state.kvscope_instance_id, set once (kvscope-<12 hex>)."""
    iid = getattr(app.state, "kvscope_instance_id", None)
    if not iid:
        iid = app.state.kvscope_instance_id = f"kvscope-{uuid.uuid4().hex[:12]}"
    return iid


def sampling_params_dict(p) -> dict:
    """kvscope's SamplingParams under vLLM's SamplingParams field names."""
    return {
        "n": 1,
        "temperature": p.temperature,
        "top_p": p.top_p,
        "top_k": p.top_k,
        "min_p": p.min_p,
        "seed": p.seed,
        "presence_penalty": p.presence_penalty,
        "frequency_penalty": p.frequency_penalty,
        "repetition_penalty": p.repetition_penalty,
        "stop": list(p.stop or []),
        "stop_token_ids": list(p.stop_token_ids or []),
        "ignore_eos": p.ignore_eos,
        "max_tokens": p.max_tokens,
        "min_tokens": p.min_tokens,
        "logprobs": p.logprobs,
        "logit_bias": {str(k): v for k, v in p.logit_bias.items()} if p.logit_bias else None,
        "include_stop_str_in_output": p.include_stop_str_in_output,
        "skip_special_tokens": p.skip_special_tokens,
    }


def _generate_request(st, body, ids: list[int], logprobs: int | None, prefix: str) -> dict:
    """vLLM's GenerateRequest for one prompt; ValueError (-> 400) when the engine would refuse it."""
    th = st.thread
    limit = getattr(body, "max_completion_tokens", None) or body.max_tokens
    engine = th.engine
    max_tokens = limit if limit is not None else engine.max_completion_tokens(len(ids), body.tier)
    params = body.sampling_params(max_tokens, logprobs)
    engine.admission_check(ids, params)  # read-only: the checks submit() would make
    return {
        "request_id": f"{prefix}-{uuid.uuid4().hex}",
        "token_ids": ids,
        "features": None,
        "sampling_params": sampling_params_dict(params),
        "model": body.model if body.model is not None else st.model_name,
        "stream": bool(body.stream),
        "stream_options": body.stream_options.model_dump() if body.stream and body.stream_options else None,
        "cache_salt": body.cache_salt,
        "priority": 0,
    }


def _check(st, body) -> None:
    check_model(st, body.model)
    if not st.thread.healthy:
        raise APIError(503, f"engine is down: {st.thread.error or 'not running'}")


@router.post("/v1/chat/completions/render")
async def render_chat(request: Request, body: ChatCompletionRequest):
    st = _state(request)
    _check(st, body)
    th = st.thread
    try:
        ids = await asyncio.to_thread(chat_prompt_ids, th, body)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        out = _generate_request(st, body, ids, logprobs, "chatcmpl")
    except ValueError as e:
        raise APIError(400, str(e), param_of(str(e)) or "messages") from None
    except EngineCrashed as e:
        raise APIError(503, f"engine is down: {e}") from None
    return JSONResponse(out)


@router.post("/v1/completions/render")
async def render_completions(request: Request, body: CompletionRequest):
    st = _state(request)
    _check(st, body)
    th = st.thread
    try:
        out = []
        for p in body.prompts():
            ids = await asyncio.to_thread(completion_prompt_ids, th, p)
            if not isinstance(p, str):
                prompt_ids(th.tokenizer, th.engine.vocab_size, ids)  # token ids checked against the vocabulary
            out.append(_generate_request(st, body, ids, body.logprobs, "cmpl"))
    except ValueError as e:
        raise APIError(400, str(e), param_of(str(e)) or "prompt") from None
    except EngineCrashed as e:
        raise APIError(503, f"engine is down: {e}") from None
    return JSONResponse(out)


@router.get("/get_server_info")
@router.get("/server_info")
async def server_info(request: Request):
    st = _state(request)
    cfg = st.thread.config
    bm = st.thread.engine.bm
    return {
        "model_path": cfg.model,
        "model_id": st.model_name,
        "served_model_name": st.model_name,
        "dp_size": 1,
        "tp_size": 1,
        "instance_id": instance_id(request.app),
        "kv_block_size": cfg.block_size,
        "max_model_len": served_max_model_len(st.thread),
        "enable_prefix_caching": bool(bm.enable_prefix_caching),
        "prefix_caching_hash_algo": bm.hasher.algo,
        "prefix_caching_hash_seed": bm.hasher.seed,
        "kv_events": st.kv_events is not None,
        "engine": "kvscope",
    }


def kv_event_sources(pub) -> dict:
    """vLLM's /kv_event_sources body for one publisher (or {} for none)."""
    if pub is None:
        return {}
    return {
        "0": {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": pub.endpoint,
            "replay_endpoint": pub.replay_endpoint,
            "topic": pub.topic.decode("utf-8"),
            "buffer_steps": pub.buffer_steps,
            "hwm": pub.hwm,
            # vllm-router 0.1.17's discovery skips (silently) an entry without these two
            "encoding": "msgpack",
            "schema_version": 1,
        }
    }


@router.get("/kv_event_sources")
async def get_kv_event_sources(request: Request):
    return JSONResponse(kv_event_sources(_state(request).kv_events))
