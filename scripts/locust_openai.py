"""A bounded locust load against kvscope's OpenAI-compatible API (docs/SERVING.md):

    locust -f scripts/locust_openai.py --headless -u 8 -r 8 -t 30s --host http://127.0.0.1:8000

Each user streams chat completions (24 tokens, greedy) and reports time to first token as its
own entry beside the whole request. Locust is not a kvscope dependency: install it in a
throwaway venv (`pip install locust==2.47.0`)."""

import json
import time

from locust import HttpUser, between, task

QUESTIONS = [
    "What is a KV cache?",
    "Why do servers page their KV cache?",
    "Explain prefix caching briefly.",
    "What does preemption cost?",
]


class ChatUser(HttpUser):
    wait_time = between(0.0, 0.2)

    @task
    def chat_stream(self):
        q = QUESTIONS[int(time.time() * 1000) % len(QUESTIONS)]
        body = {
            "messages": [{"role": "user", "content": q}],
            "max_tokens": 24,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        t0 = time.perf_counter()
        first = None
        with self.client.post(
            "/v1/chat/completions", json=body, stream=True, catch_response=True, name="chat stream"
        ) as r:
            if r.status_code != 200:
                r.failure(f"HTTP {r.status_code}")
                return
            done = False
            for line in r.iter_lines():
                if not line:
                    continue
                if line == b"data: [DONE]":
                    done = True
                    break
                d = json.loads(line[6:])
                if first is None and d.get("choices") and d["choices"][0]["delta"].get("content"):
                    first = time.perf_counter()
            if not done:
                r.failure("stream ended without [DONE]")
        if first is not None:
            self.environment.events.request.fire(
                request_type="TTFT",
                name="first token",
                response_time=(first - t0) * 1000,
                response_length=0,
                exception=None,
                context={},
            )
