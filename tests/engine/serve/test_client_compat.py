"""Real clients against the real server, unchanged: the OpenAI SDK multi-turn pattern (the returned
message appended to the history, with and without tool calls) and LangChain's ChatOpenAI
(`with_structured_output(method="json_schema")`, `bind_tools` + invoke with a forced tool) and
LiteLLM's completion with `logit_bias` (its cost map read locally). LangSmith tracing is off (no
network)."""

import os

import pytest
from pydantic import BaseModel, Field

from .conftest import API_KEY
from .test_tools import ASK, TOOLS, WEATHER

os.environ.setdefault("LANGSMITH_TRACING", "false")


def test_openai_sdk_multi_turn_with_tools(tools_server):
    from openai import OpenAI

    client = OpenAI(base_url=tools_server.base + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
    history = [*ASK]
    kw = dict(model="kvscope-tools", tools=TOOLS, max_tokens=60, temperature=0)
    r1 = client.chat.completions.create(messages=history, tool_choice="required", **kw)
    history.append(r1.choices[0].message)
    history.append({"role": "tool", "tool_call_id": r1.choices[0].message.tool_calls[0].id, "content": "21 C"})
    r2 = client.chat.completions.create(messages=history, tool_choice="none", **kw)
    history.append(r2.choices[0].message)  # a plain answer: tool_calls [], refusal None
    history.append({"role": "user", "content": "Thanks. And Rome?"})
    r3 = client.chat.completions.create(messages=history, **kw)
    assert r3.choices[0].message.role == "assistant"
    assert r3.usage.prompt_tokens > r2.usage.prompt_tokens > r1.usage.prompt_tokens


class Weather(BaseModel):
    city: str = Field(json_schema_extra={"enum": ["Paris", "Rome"]})
    sunny: bool


@pytest.fixture(scope="module")
def chat_model(tools_server):
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        base_url=tools_server.base + "/v1", api_key=API_KEY, model="kvscope-tools", temperature=0, max_tokens=60
    )


def test_langchain_with_structured_output_json_schema(chat_model):
    out = chat_model.with_structured_output(Weather, method="json_schema").invoke("Weather in Paris?")
    assert isinstance(out, Weather) and out.city in ("Paris", "Rome")


def test_langchain_bind_tools_invoke(chat_model):
    msg = chat_model.bind_tools([WEATHER], tool_choice="get_weather").invoke("Weather in Paris?")
    assert len(msg.tool_calls) == 1
    call = msg.tool_calls[0]
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    assert call["args"]["city"] in ("Paris", "Rome") and call["args"]["unit"] in ("C", "F")
    # auto: the request is accepted; whatever the random model says comes back as an AIMessage
    free = chat_model.bind_tools([WEATHER]).invoke("Weather in Paris?")
    assert isinstance(free.content, str)


def test_litellm_with_logit_bias(server):
    """LiteLLM (openai-compatible provider) sends logit_bias as given; +100 on one ordinary token
    makes the greedy answer that token repeated."""
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no cost-map download
    litellm = pytest.importorskip("litellm")
    r = litellm.completion(
        model="openai/kvscope-tiny",
        api_base=server.base + "/v1",
        api_key=API_KEY,
        messages=[{"role": "user", "content": "Hi"}],
        logit_bias={"1000": 100},
        max_tokens=4,
        temperature=0,
    )
    assert r.choices[0].message.content == server.thread.tokenizer.decode([1000] * 4)
    assert r.usage.completion_tokens == 4
