"""One kvscope server for the serve tests: the tiny model on an EngineThread, served by uvicorn
from a background thread on 127.0.0.1 and a free port, with an API key. Session-scoped: every
test leaves the engine idle (no request running or waiting) and checks that it did."""

from contextlib import contextmanager

import pytest

from engine.serve.ports import free_port

API_KEY = "sk-kvscope-test"
TINY_SERVE = {
    "model": "tiny",
    "device": "cpu",
    "num_kv_blocks": 160,
    "block_size": 8,
    "max_model_len": 256,
    "max_num_seqs": 16,
    "max_num_batched_tokens": 512,
    "num_threads": 1,
}


class Server:
    def __init__(self, thread, app, server, port):
        self.thread, self.app, self.server, self.port = thread, app, server, port
        self.base = f"http://127.0.0.1:{port}"
        self.headers = {"Authorization": f"Bearer {API_KEY}"}

    def http(self):
        """An httpx client on this server with its API key (use as a context manager)."""
        import httpx

        return httpx.Client(base_url=self.base, headers=self.headers, timeout=120)

    def openai(self):
        """The OpenAI SDK's client on this server (no retries)."""
        from openai import OpenAI

        return OpenAI(base_url=self.base + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@contextmanager
def serving(th, **app_kw):
    """EngineThread `th` served by uvicorn on a free port with API_KEY; on exit the server stops
    and the thread is shut down."""
    from engine.serve import create_app, run_in_background

    app = create_app(th, api_key=API_KEY, **app_kw)
    port = free_port()
    srv = run_in_background(app, "127.0.0.1", port)
    assert srv.started
    try:
        yield Server(th, app, srv, port)
    finally:
        srv.should_exit = True
        srv.thread.join(10)
        th.shutdown()


@pytest.fixture(scope="session")
def server():
    from engine.config import EngineConfig
    from engine.core.thread import EngineThread

    th = EngineThread(config=EngineConfig(**TINY_SERVE))
    with serving(th, model_name="kvscope-tiny", max_body_bytes=64 * 1024, max_waiting=512) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    """httpx client on `server` with its API key (a module overrides it to talk to another)."""
    with server.http() as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    """The OpenAI SDK on `server`."""
    return server.openai()


@pytest.fixture(scope="session")
def llm():
    """In-process reference on the same config (same seeded tiny weights)."""
    from engine import LLM

    return LLM(**TINY_SERVE)


# A Hermes / Qwen-style chat template that renders `tools` (the default model's does not): the tool
# definitions in a system turn, assistant tool calls as <tool_call> blocks, role tool as
# <tool_response> in a user turn.
TOOLS_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nCall a function when it helps. Functions:\n<tools>\n"
    "{%- for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    'Answer a call as <tool_call>\n{"name": <name>, "arguments": <object>}\n</tool_call><|im_end|>\n'
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{{ message.content or '' }}"
    "{%- for tc in message.tool_calls %}<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}<|im_end|>\n"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOLS_SERVE = dict(
    TINY_SERVE, model="mem:tiny-tools", num_kv_blocks=320, max_model_len=1024, max_num_batched_tokens=1024
)


@pytest.fixture(scope="session")
def tools_server():
    """A second server: the tiny model (the same weights) with its own tokenizer copy whose chat
    template renders tools (TOOLS_TEMPLATE)."""
    from transformers import AutoTokenizer

    from engine.config import EngineConfig
    from engine.core.thread import EngineThread
    from engine.model.models import default_hf_folder, load_model, register_model, unregister_model

    model, _ = load_model("tiny", "cpu", "float32")
    tok = AutoTokenizer.from_pretrained(default_hf_folder())
    tok.chat_template = TOOLS_TEMPLATE
    register_model("mem:tiny-tools", model, tok)
    th = EngineThread(config=EngineConfig(**TOOLS_SERVE))
    with serving(th, model_name="kvscope-tools", max_body_bytes=256 * 1024, max_waiting=64) as srv:
        yield srv
    unregister_model("mem:tiny-tools")


@pytest.fixture
def spec_thread():
    """A fresh tiny-model EngineThread that speculates (self-draft, 1 draft layer, 3 tokens), for
    the tests that compare one speculative request's numbers across the page, the API and
    /metrics; shut down after the test."""
    from engine import EngineConfig
    from engine.core.thread import EngineThread

    th = EngineThread(
        config=EngineConfig(
            model="tiny",
            device="cpu",
            num_kv_blocks=64,
            block_size=8,
            max_model_len=256,
            num_threads=1,
            speculative_config={"method": "self_draft", "draft_layers": 1, "num_speculative_tokens": 3},
        )
    )
    yield th
    th.shutdown()
