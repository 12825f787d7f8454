"""The official openai client against `python -m engine serve`'s app: chat and completions,
streamed and not, usage counts, greedy text equal to LLM.generate, n > 1 sharing the prompt's
blocks (ref count n), logprobs, min_tokens."""

import pytest

from engine import SamplingParams

PROMPT = "The paged KV cache stores keys and values in fixed-size blocks so that"
MSG = "Explain prefix caching in one sentence."


def idle(th):
    with th.lock:
        th.engine.check_invariants()
        assert not th.engine.has_unfinished_requests()
        assert th.engine.bm.num_used_blocks == 0


def reference(llm, prompt, max_tokens):
    return llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens))[0]


def chat_ids(llm, text):
    return llm.engine.apply_chat_template(text)


def test_models_lists_the_served_name(client):
    ids = [m.id for m in client.models.list().data]
    assert ids == ["kvscope-tiny"]


def test_completion_greedy_equals_llm_generate(client, server, llm):
    ref = reference(llm, PROMPT, 12)
    r = client.completions.create(model="kvscope-tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    assert r.choices[0].text == ref.outputs[0].text
    assert r.choices[0].finish_reason == ref.outputs[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == 12
    assert r.usage.total_tokens == len(ref.prompt_token_ids) + 12
    idle(server.thread)


def test_completion_token_id_prompt(client, llm):
    ids = llm.tokenizer.encode(PROMPT, add_special_tokens=False)
    ref = reference(llm, ids, 6)
    r = client.completions.create(model="kvscope-tiny", prompt=ids, max_tokens=6, temperature=0)
    assert r.choices[0].text == ref.outputs[0].text
    assert r.usage.prompt_tokens == len(ids)


def test_completion_stream_equals_non_stream(client, server, llm):
    ref = reference(llm, PROMPT, 10)
    chunks = list(
        client.completions.create(
            model="kvscope-tiny",
            prompt=PROMPT,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == ref.outputs[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    usage = [c.usage for c in chunks if c.usage is not None]
    assert len(usage) == 1 and not chunks[-1].choices
    assert (usage[0].prompt_tokens, usage[0].completion_tokens) == (len(ref.prompt_token_ids), 10)
    idle(server.thread)


def test_chat_greedy_equals_llm_generate_on_the_template(client, server, llm):
    ref = reference(llm, chat_ids(llm, MSG), 12)
    r = client.chat.completions.create(
        model="kvscope-tiny", messages=[{"role": "user", "content": MSG}], max_tokens=12, temperature=0
    )
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == len(ref.outputs[0].token_ids)
    idle(server.thread)


def test_chat_stream_with_usage(client, server, llm):
    ref = reference(llm, chat_ids(llm, MSG), 9)
    stream = client.chat.completions.create(
        model="kvscope-tiny",
        messages=[{"role": "user", "content": MSG}],
        max_completion_tokens=9,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.outputs[0].text
    assert chunks[-1].usage.completion_tokens == len(ref.outputs[0].token_ids)
    assert chunks[-1].usage.prompt_tokens == len(ref.prompt_token_ids)
    assert all(c.usage is None for c in chunks[:-1])
    idle(server.thread)


def test_stream_ends_with_done(server):
    import httpx

    body = {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.base + "/v1/completions", json=body, headers=server.headers) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    assert lines[-1] == "data: [DONE]" and all(ln.startswith("data: ") for ln in lines)


def test_n_choices_fork_the_prompt_blocks(client, server, llm):
    """n=3: the two later choices are admitted on the first one's cached prompt blocks, so every
    full prompt block has ref count 3 while they run, as a fork in vLLM."""
    th = server.thread
    bs = th.config.block_size
    prompt = PROMPT + " every request shares the same prefix blocks"
    ids = llm.tokenizer.encode(prompt, add_special_tokens=False)
    full = (len(ids) - 1) // bs  # the prompt's last token is always computed, never a cache hit
    assert full >= 2
    seen, shared = set(), None
    stream = client.completions.create(
        model="kvscope-tiny",
        prompt=prompt,
        max_tokens=48,
        temperature=0,
        n=3,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    texts = ["", "", ""]
    for c in stream:
        for ch in c.choices:
            texts[ch.index] += ch.text
            seen.add(ch.index)
        if shared is None and seen == {0, 1, 2}:
            with th.lock:  # the engine cannot step meanwhile: all three are running
                snap = th.engine.snapshot()
            http = [r for r in snap.requests if r.origin == "http" and r.state == "running"]
            assert len(http) == 3
            tables = [r.block_table[:full] for r in http]
            assert tables[0] == tables[1] == tables[2]
            refs = {b.block_id: b.ref_count for b in snap.blocks}
            shared = [refs[b] for b in tables[0]]
    assert shared == [3] * full
    ref = reference(llm, prompt, 48).outputs[0].text
    assert texts == [ref, ref, ref]  # greedy: three equal choices
    idle(th)


def test_logprobs_are_the_models_log_softmax(client, llm):
    import torch

    r = client.completions.create(model="kvscope-tiny", prompt=PROMPT, max_tokens=3, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    ids = llm.tokenizer.encode(PROMPT, add_special_tokens=False)
    out = reference(llm, ids, 3).outputs[0]
    with torch.no_grad():
        logits = llm.engine.model(torch.tensor([ids + out.token_ids[:1]])).logits[0, -2:].float()
    want = torch.log_softmax(logits, -1)
    assert lp.token_logprobs[0] == pytest.approx(float(want[0, out.token_ids[0]]), abs=1e-4)
    assert lp.token_logprobs[1] == pytest.approx(float(want[1, out.token_ids[1]]), abs=1e-4)
    assert all(len(t) >= 2 for t in lp.top_logprobs)
    # greedy: the sampled token is the top one
    assert max(lp.top_logprobs[0].values()) == pytest.approx(lp.token_logprobs[0])


def test_chat_logprobs(client):
    r = client.chat.completions.create(
        model="kvscope-tiny",
        messages=[{"role": "user", "content": MSG}],
        max_tokens=2,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = r.choices[0].logprobs.content
    assert len(content) == 2 and all(len(c.top_logprobs) == 3 for c in content)
    assert content[0].logprob == pytest.approx(content[0].top_logprobs[0].logprob)


def test_min_tokens_masks_the_stop_token(client, llm):
    first = reference(llm, PROMPT, 1).outputs[0].token_ids[0]
    r = client.completions.create(
        model="kvscope-tiny", prompt=PROMPT, max_tokens=6, temperature=0, extra_body={"stop_token_ids": [first]}
    )
    assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1
    r = client.completions.create(
        model="kvscope-tiny",
        prompt=PROMPT,
        max_tokens=6,
        temperature=0,
        extra_body={"stop_token_ids": [first], "min_tokens": 3},
    )
    assert r.usage.completion_tokens >= 3
    # the masked first token is the runner-up of the model's distribution
    lp = client.completions.create(model="kvscope-tiny", prompt=PROMPT, max_tokens=1, temperature=0, logprobs=2)
    second = next(t for t in lp.choices[0].logprobs.top_logprobs[0] if t != llm.tokenizer.decode([first]))
    assert r.choices[0].text.startswith(second)


def test_seeded_sampling_is_reproducible(client):
    kw = {
        "model": "kvscope-tiny",
        "prompt": PROMPT,
        "max_tokens": 8,
        "temperature": 0.9,
        "top_p": 0.9,
        "seed": 7,
        "extra_body": {"top_k": 50},
    }
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b


def test_stop_string_is_cut(client, llm):
    ref = reference(llm, PROMPT, 12).outputs[0].text
    stop = ref[len(ref) // 2 : len(ref) // 2 + 3]
    r = client.completions.create(model="kvscope-tiny", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == ref[: ref.index(stop)]
    chunks = list(
        client.completions.create(
            model="kvscope-tiny", prompt=PROMPT, max_tokens=12, temperature=0, stop=[stop], stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref[: ref.index(stop)]


def test_continuous_usage_stats(server):
    import json

    import httpx

    body = {
        "prompt": PROMPT,
        "max_tokens": 5,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    with httpx.stream("POST", server.base + "/v1/completions", json=body, headers=server.headers, timeout=120) as r:
        msgs = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
    seen = [m["usage"]["completion_tokens"] for m in msgs]
    assert all(m["usage"] is not None for m in msgs) and seen == sorted(seen) and seen[-1] == 5
