"""Structured output (response_format json_object / json_schema) with llguidance as a token mask:
every output parses as JSON and validates against its schema (nested objects, enums, arrays),
greedy and sampled; greedy is deterministic; the speculative engine leaves such requests on plain
steps (same tokens, no drafts); bad schemas are a ValueError naming response_format."""

import json

import jsonschema
import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams, SpeculativeConfig
from engine.core.structured import mask_logits
from engine.observe import trace_events as ev
from tests.engine.engines import one_output, tiny_engine

SCHEMAS = {
    "nested_enum_array": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "color": {"enum": ["red", "green", "blue"]},
            "tags": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
            "inner": {
                "type": "object",
                "properties": {"ok": {"type": "boolean"}, "level": {"enum": [1, 2, 3]}},
                "required": ["ok", "level"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "color", "tags", "inner"],
        "additionalProperties": False,
    },
    "array_of_objects": {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"id": {"type": "integer"}, "kind": {"enum": ["a", "b"]}},
            "required": ["id", "kind"],
            "additionalProperties": False,
        },
        "minItems": 1,
        "maxItems": 3,
    },
}


def rf(schema):
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}


def run(eng, params, prompt="Answer in JSON:"):
    return one_output(eng, prompt, params)


@pytest.fixture(scope="module")
def tiny():
    return tiny_engine()


@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("temperature,seed", [(0.0, None), (1.0, 1), (1.0, 2)])
def test_output_parses_and_validates(tiny, name, temperature, seed):
    p = SamplingParams(max_tokens=300, temperature=temperature, seed=seed, response_format=rf(SCHEMAS[name]))
    out = run(tiny, p)
    assert out.finish_reason == "stop", out.text  # the grammar completed, then EOS
    jsonschema.validate(json.loads(out.text), SCHEMAS[name])


def test_json_object_output_is_always_a_valid_object_prefix(tiny):
    """The random model never closes its strings, so the budget ends it: every token it emitted is
    still accepted by a fresh json_object matcher (the output is a prefix of a JSON object)."""
    fmt = {"type": "json_object"}
    out = run(tiny, SamplingParams(max_tokens=60, temperature=1.0, seed=3, response_format=fmt))
    assert out.finish_reason == "length" and out.text.startswith("{")
    assert tiny.grammars.matcher(fmt).m.validate_tokens(out.token_ids) == len(out.token_ids) == 60
    plain = run(tiny, SamplingParams(max_tokens=60, temperature=1.0, seed=3))
    assert tiny.grammars.matcher(fmt).m.validate_tokens(plain.token_ids) < 60  # the mask did something


def test_greedy_is_deterministic_and_the_mask_is_what_it_says(tiny):
    p = SamplingParams(max_tokens=300, response_format=rf(SCHEMAS["nested_enum_array"]))
    a, b = run(tiny, p), run(tiny, p)
    assert a.token_ids == b.token_ids
    m = tiny.grammars.matcher(rf(SCHEMAS["nested_enum_array"]))
    allowed = m.allowed()
    assert allowed.shape == (tiny.vocab_size,) and 0 < int(allowed.sum()) < 100  # only tokens starting '{'
    first = tiny.tokenizer.decode([int(allowed.nonzero()[0])])
    assert first.lstrip().startswith("{")
    x = mask_logits(torch.zeros(tiny.vocab_size), m)
    assert torch.equal(torch.isfinite(x), allowed)


def test_speculative_engine_gives_the_same_tokens_without_drafts(tiny):
    sc = SpeculativeConfig(method="self_draft", draft_layers=1, num_speculative_tokens=4)
    spec = LLMEngine(EngineConfig(model="tiny", num_threads=1, speculative=sc))
    p = SamplingParams(max_tokens=300, response_format=rf(SCHEMAS["array_of_objects"]))
    assert run(spec, p).token_ids == run(tiny, p).token_ids
    assert not spec.events.since(0, kinds=[ev.SPEC_VERIFY])


@pytest.mark.parametrize(
    "fmt",
    [
        {"type": "xml"},
        {"type": "json_schema"},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": "not a schema"}},
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nosuchtype"}}},
    ],
)
def test_bad_response_format_names_the_field(tiny, fmt):
    with pytest.raises(ValueError, match="response_format"):
        tiny.add_request(None, "x", SamplingParams(response_format=fmt))
    assert tiny.get_num_unfinished_requests() == 0
