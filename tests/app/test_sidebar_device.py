"""The sidebar offers the device when a GPU is present (engine/model/device.py decides the list). On a
CPU-only machine the GPU's presence is mocked: the Device choice appears, choosing the CPU
rebuilds the engine there, choosing CUDA without CUDA is a clear message, not a traceback."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.usefixtures("tiny_test_mode")


def _select(at, label):
    for s in at.sidebar.selectbox:
        if s.label == label:
            return s
    return None


def _apply(at):
    at.sidebar.checkbox[0].check()
    for b in at.sidebar.button:
        if b.label == "Apply":
            b.click()
    return at.run()


def test_device_offered_only_with_a_gpu(monkeypatch, app_test):
    from ui.widgets import engine_access as ea

    if not torch.cuda.is_available():
        at = app_test().run()
        assert not at.exception
        assert _select(at, "Device") is None
    monkeypatch.setattr(ea, "detect_devices", lambda: ["cuda", "cpu"])
    at = app_test().run()
    dev = _select(at, "Device")
    assert dev is not None and dev.options == ["cuda", "cpu"]
    dev.select("cpu")
    at = _apply(at)
    assert not at.exception
    assert ea.get_engine().snapshot_now().info.device == "cpu"
    if torch.cuda.is_available():
        return
    _select(at, "Device").select("cuda")
    at = _apply(at)
    assert not at.exception
    assert any("CUDA is not available" in e.value for e in at.sidebar.error)
