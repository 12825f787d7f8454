"""engine/core/output_processor.py works on the engine through a typed interface (StepEngine):
every attribute it reads of `eng` is one StepEngine declares, none is private, and LLMEngine has
each of StepEngine's methods."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

from engine.core import output_processor
from engine.core.engine import LLMEngine
from engine.core.output_processor import StepEngine

SRC = Path(output_processor.__file__)


def eng_attributes() -> set[str]:
    return {
        n.attr
        for n in ast.walk(ast.parse(SRC.read_text()))
        if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "eng"
    }


def test_the_output_processor_uses_only_what_step_engine_declares():
    declared = set(StepEngine.__annotations__) | {
        name for name, v in vars(StepEngine).items() if inspect.isfunction(v) and not name.startswith("_")
    }
    used = eng_attributes()
    assert used and not [a for a in used if a.startswith("_")]
    assert used <= declared, f"undeclared: {sorted(used - declared)}"


def test_llm_engine_has_the_methods_step_engine_declares():
    methods = [name for name, v in vars(StepEngine).items() if inspect.isfunction(v) and not name.startswith("_")]
    assert {"emit", "finish_request", "end_step", "now", "decode"} <= set(methods)
    for name in methods:
        assert callable(getattr(LLMEngine, name, None)), name
