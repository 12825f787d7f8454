"""AppTest of the app shell (Home, sidebar settings, navigation) and of the Playground and
Speculative pages, on the real engine with the tiny model in test mode.

All tests in this module share the server-wide engine (st.cache_resource lives in-process), as
browser sessions do; it is shut down at the end of the module.
"""

from __future__ import annotations

import json

import pytest

from tests.app import helpers as H
from tests.app.helpers import TIMEOUT
from tests.waiting import wait_until

pytestmark = pytest.mark.usefixtures("tiny_test_mode")


def _restore_default_engine():
    from ui.widgets import engine_access as ea

    th = H.engine()
    if th.config != ea.default_config():
        ea.shared_engine().reconfigure(ea.default_config())


# --------------------------------------------------------------------------- Home


def test_home_shows_the_real_engine(app_test):
    at = app_test().run()
    H.no_exception(at)
    th = H.engine()
    from engine.model.models import load_model

    hf = load_model("tiny")[0].config  # the model's own shape (the engine may run in another process)
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    expected = 2 * hf.num_hidden_layers * hf.num_key_value_heads * head_dim * 4  # float32
    assert H.metric(at, "KV bytes per token") == f"{expected:,}"
    assert H.metric(at, "Model") == "tiny"
    assert H.metric(at, "Device · dtype") == "cpu · float32"
    info = th.snapshot().info
    assert H.metric(at, "KV budget") == f"{info.kv_cache_bytes / 2**20:,.2f} MiB"
    assert any("Engine healthy" in s.value for s in at.success)
    # the memory calculator gets the loaded model's shape from the session
    assert at.session_state["engine_info"].bytes_per_token == expected
    assert "cached-free" in H.html(at) and "draft rejected" in H.html(at)


def test_home_and_sidebar_show_the_weight_format_and_bytes_read(app_test):
    from ui.widgets import engine_access as ea

    at = app_test().run()
    H.no_exception(at)
    info = H.engine().snapshot().info
    assert info.weight_format == "fp32" and info.weight_bytes_per_step > 0  # tiny: no GGUF behind it
    shown = f"fp32 copies · {info.weight_bytes_per_step / 1e6:,.1f} MB of weights read per step"
    assert any(shown in c.value for c in at.caption)
    wf = next(s for s in at.sidebar.selectbox if s.label == "Weight format")
    assert wf.options[wf.index] == ea.WEIGHT_FORMAT_LABELS["auto"]
    wf.select("gguf")  # the tiny model has no GGUF: a message naming the field
    at.sidebar.checkbox[0].check()
    H.button(at, "Apply").click().run()
    H.no_exception(at)
    assert any("weight_format='gguf'" in e.value for e in at.sidebar.error)
    assert H.engine().snapshot().info.weight_format == "fp32"


def test_home_offers_restart_after_a_crash(app_test):
    th = H.engine()
    H.crash_next_step(th, "injected loop failure")  # the next step kills the loop
    th.submit("hello", chat=True)
    wait_until(lambda: not th.healthy, "the injected failure to stop the loop", TIMEOUT)
    at = app_test().run()
    H.no_exception(at)
    assert any("injected loop failure" in e.value for e in at.error)
    from ui.widgets import engine_access as ea

    H.button(at, ea.restart_label(th)).click().run()  # "Start a new engine core" in process mode
    H.no_exception(at)
    assert th.healthy
    assert any("Engine healthy" in s.value for s in at.success)


def test_sidebar_apply_needs_confirmation_then_rebuilds(app_test):
    at = app_test().run()
    sb = at.sidebar
    sb.selectbox[0].select(8)  # block size
    sb.number_input[0].set_value(64)  # KV blocks
    H.button(at, "Apply").click().run()
    H.no_exception(at)
    assert any("Tick the confirmation" in w.value for w in at.sidebar.warning)
    assert H.engine().snapshot().info.block_size == 4
    at.sidebar.selectbox[0].select(8)
    at.sidebar.number_input[0].set_value(64)
    at.sidebar.checkbox[0].check()
    H.button(at, "Apply").click().run()
    H.no_exception(at)
    info = H.engine().snapshot_now().info
    assert (info.block_size, info.num_blocks) == (8, 64)
    assert any("rebuilt" in s.value for s in at.sidebar.success)
    assert H.metric(at, "KV budget") == f"{info.kv_cache_bytes / 2**20:,.2f} MiB"
    _restore_default_engine()


def test_operator_token_gates_engine_wide_changes(monkeypatch, app_test):
    monkeypatch.setenv("KVSCOPE_OPERATOR_TOKEN", "tok-123")
    at = app_test().run()
    H.no_exception(at)
    caps = " ".join(c.value for c in at.sidebar.caption)
    assert "Viewer: your own prompts only" in caps
    assert "nothing would be aborted" in caps or "in-flight request(s)" in caps
    assert H.button(at, "Apply").disabled
    at.sidebar.text_input(key="operator_token_input").input("wrong").run()
    assert H.button(at, "Apply").disabled
    at.sidebar.text_input(key="operator_token_input").input("tok-123").run()
    assert not H.button(at, "Apply").disabled
    assert "Operator: you can change the engine" in " ".join(c.value for c in at.sidebar.caption)


def test_sidebar_sets_victim_policy_and_tier_caps(app_test):
    """Victim policy, a tier's cap and the default tier reach the engine; the playground preview
    then rejects a request over that cap with the engine's own reason."""
    at = app_test().run()
    at.sidebar.selectbox(key="sb_victim_policy").select("lru")
    at.sidebar.number_input(key="sb_tier_free").set_value(60)
    at.sidebar.selectbox(key="sb_default_tier").select("free")
    at.sidebar.checkbox[0].check()
    H.button(at, "Apply").click().run()
    H.no_exception(at)
    cfg = H.engine().config
    assert (cfg.victim_policy, cfg.tiers["free"].max_context, cfg.default_tier) == ("lru", 60, "free")
    assert H.engine().snapshot_now().info.victim_policy == "lru"
    at.switch_page("pages/playground.py")
    _type(at, "pg", "Name three colours.")
    at.run()
    at.slider(key="pg_max_tokens").set_value(40)
    at.run()
    H.no_exception(at)
    assert any(
        "Would be rejected" in e.value and "context cap of tier 'free': 60 tokens" in e.value for e in at.error
    ), [e.value for e in at.error] + [m.value for m in at.markdown][:3]
    _restore_default_engine()


# --------------------------------------------------------------------------- Playground


def _type(at, prefix, text, field="prompt"):
    """What a keystroke sends: the keyup field's component state (the browser test types for real)."""
    at.session_state[f"_st_keyup_{prefix}_{field}"] = {"value": text}


def _playground(app_test):
    at = app_test()
    at.switch_page("pages/playground.py")
    return at.run()


def test_playground_generates_and_draws_the_engine_state(app_test):
    at = _playground(app_test)
    H.no_exception(at)
    _type(at, "pg", "Name three colours.")
    at.slider(key="pg_max_tokens").set_value(12)
    H.button(at, "Generate").click().run()
    H.no_exception(at)
    th = H.engine()
    snap = th.snapshot_now()
    rid = at.session_state["pg_rid"]
    req = snap.request(rid)
    assert req is not None and req.state == "finished" and req.output_len == 12
    # the answer is the engine's text
    assert at.session_state["pg_answer"] == req.output_text
    specs = H.plotly_specs(at)
    pool_map = specs[0]
    cells = [v for row in pool_map["data"][0]["z"] for v in row if v is not None]
    assert len(cells) == snap.info.num_blocks
    assert "used" in pool_map["layout"]["title"]["text"]
    growth = next(s for s in specs if "cache growth" in s["layout"]["title"]["text"])
    tokens_line = next(t for t in growth["data"] if t.get("name") == "tokens in cache")
    assert tokens_line["y"] == [p.num_cached_tokens for p in req.history]
    assert H.metric(at, "Prompt · output") == f"{req.prompt_len} · {req.output_len}"
    strip = H.html(at)
    assert strip.count("tok-plain") == req.output_len
    assert st_static_config(at)


def test_playground_redraw_builds_nothing_when_the_engine_is_unchanged(app_test):
    """A rerun on an unchanged engine state reuses the figures it built (ui/widgets/redraw.py):
    the same Plotly specs, no new builds; a step of the engine builds them again."""
    at = _playground(app_test)
    _type(at, "pg", "Name two colours.")
    at.slider(key="pg_max_tokens").set_value(4)
    H.button(at, "Generate").click().run()
    H.no_exception(at)
    specs = H.plotly_specs(at)
    builds = at.session_state["redraw_memo_stats"]["builds"]
    at.run()
    H.no_exception(at)
    assert at.session_state["redraw_memo_stats"]["builds"] == builds
    assert H.plotly_specs(at) == specs


def st_static_config(at) -> bool:
    """Test mode: every chart is static (no hover, no mode bar, no resize)."""
    for el in at.main.get("plotly_chart"):
        cfg = json.loads(el.proto.config)
        if not (
            cfg.get("staticPlot") is True and cfg.get("displayModeBar") is False and cfg.get("responsive") is False
        ):
            return False
    return True


HOSTILE = '<script>alert(1)</script><img src=x onerror=alert(2)>"><svg onload=alert(3)> \u202eevil\u200b'


def test_playground_prompt_is_data_not_markup(app_test):
    at = _playground(app_test)
    _type(at, "pg", HOSTILE)
    at.slider(key="pg_max_tokens").set_value(4)
    H.button(at, "Generate").click().run()
    H.no_exception(at)
    # the prompt is echoed as plain text, never as HTML; the preview's chips escape every token
    assert any(HOSTILE in t.value for t in at.text)
    assert "kvscope-preview-block" in H.html(at)
    html = H.html(at)
    for bad in ("<script", "<img", "<svg", "onerror=", "onload=", "\u202e"):
        assert bad not in html


def test_playground_bad_input_is_a_message_not_a_traceback(app_test):
    at = _playground(app_test)
    _type(at, "pg", "   ")
    H.button(at, "Generate").click().run()
    H.no_exception(at)
    assert any("Not submitted" in e.value and "prompt" in e.value for e in at.error)


def test_playground_preview_follows_typing_and_changes_nothing(app_test):
    """Each keystroke reruns the preview: counts from the engine's own tokenizer and pool, the
    system-prompt edit's block, and not one change in the engine's snapshot."""
    from engine.config import SamplingParams
    from engine.core.preview import template_ids

    at = _playground(app_test)
    th = H.engine()
    system = "You are the release-freeze assistant. Answer briefly."
    _type(at, "pg", system, field="system")
    _type(at, "pg", "Is the <b>API</b> frozen?")
    at.slider(key="pg_max_tokens").set_value(8)
    at.run()
    H.button(at, "Generate").click().run()
    H.no_exception(at)
    before = th.snapshot_now()
    for typed in ("W", "Wh", "What", "What is frozen"):
        _type(at, "pg", typed)
        at.run()
        H.no_exception(at)
        ids, content = template_ids(th.tokenizer, typed, system)
        text = "\n".join(m.value for m in at.markdown)
        assert f"**{len(ids)} tokens** with the chat template: {content} typed + {len(ids) - content} template" in text
        pv = th.preview(typed, SamplingParams(max_tokens=8), system=system)
        assert pv.hit_blocks >= 1 and f"blocks 0–{pv.hit_blocks - 1}" in text
    after = th.snapshot_now()
    assert (after.blocks, after.requests, after.step) == (before.blocks, before.requests, before.step)
    _type(at, "pg", system.replace("briefly", "kindly"), field="system")
    at.run()
    edited, _ = template_ids(th.tokenizer, "What is frozen", system.replace("briefly", "kindly"))
    first = next(
        i
        for i, (a, b) in enumerate(zip(edited, template_ids(th.tokenizer, "Is the <b>API</b> frozen?", system)[0]))
        if a != b
    )
    assert f"differs from the previous prompt at token {first} → block {first // 4}" in "\n".join(
        m.value for m in at.markdown
    )
    assert "<b>API" not in H.html(at)


def test_evict_of_a_finished_request_explains_itself(app_test):
    at = _playground(app_test)
    _type(at, "pg", "Hi")
    at.slider(key="pg_max_tokens").set_value(3)
    H.button(at, "Generate").click().run()
    H.button(at, "Evict KV cache").click().run()
    H.no_exception(at)
    assert any("Nothing to evict" in w.value for w in at.warning)


def test_evicted_request_shows_the_recompute(app_test):
    """A request evicted while running: the growth chart marks the eviction, the token strip
    marks the tokens whose K/V were recomputed, the prompt's recompute is counted."""
    from engine.config import SamplingParams

    th = H.engine()
    h = th.submit("Count slowly to one hundred.", SamplingParams(max_tokens=200, ignore_eos=True), chat=True)
    # the handle's latest output (the engine may run in another process)
    wait_until(lambda: h.output is not None and len(h.output.outputs[0].token_ids) >= 5, "5 tokens", TIMEOUT, 0.005)
    th.evict(h.request_id)  # 5 of 200 tokens: still running
    h.result(TIMEOUT)
    at = app_test()
    at.session_state["pg_rid"] = h.request_id
    at.session_state["pg_prompt"] = "Count slowly to one hundred."
    at.switch_page("pages/playground.py")
    at.run()
    H.no_exception(at)
    req = th.snapshot_now().request(h.request_id)
    assert req.state == "finished" and req.num_preemptions >= 1
    growth = next(s for s in H.plotly_specs(at) if "cache growth" in s["layout"]["title"]["text"])
    assert any("evicted" in a.get("text", "") for a in growth["layout"]["annotations"])
    tokens_line = next(t for t in growth["data"] if t.get("name") == "tokens in cache")
    ys = tokens_line["y"]
    first = next(i for i, y in enumerate(ys) if y > 0)
    drop = next(i for i in range(first, len(ys)) if ys[i] == 0)
    assert max(ys[first:drop]) >= req.prompt_len + 4  # grew through prefill and decode
    assert max(ys[drop:]) >= req.prompt_len + 4  # dropped to 0, then recomputed
    html = H.html(at)
    assert "tok-evicted" in html and f"prompt: {req.prompt_len} tokens recomputed" in html


# --------------------------------------------------------------------------- Speculative


def test_speculative_page_measures_a_real_run(app_test):
    at = app_test()
    at.switch_page("pages/speculative.py")
    at.run()
    H.no_exception(at)
    at.selectbox(key="spec_drafter").select("self-draft: int8 copy")
    at.slider(key="spec_k").set_value(3)
    at.slider(key="spec_max_tokens").set_value(24)
    at.run()
    from ui.widgets import engine_access as ea
    from ui.widgets import room

    gen, before = ea.shared_engine().generation, H.engine().snapshot().info.speculative
    at.button(key="spec_run").click().run()
    H.no_exception(at)
    # measured on a private engine: the shared engine was not rebuilt and keeps its settings
    assert ea.shared_engine().generation == gen
    assert H.engine().snapshot().info.speculative == before
    run = room.room().get(at.query_params["run"])
    assert run is not None and run.kind == "speculative" and run.status == "done", run
    res = run.result
    sreq, preq = res.spec, res.plain
    assert res.label == "self_draft k=3"
    assert res.comparison.rounds == 3 and [s for _, s in res.comparison.order[:4]] == ["plain", "spec", "spec", "plain"]
    assert "median of 3 rounds" in H.html(at) + " ".join(str(c.value) for c in list(at.caption) + list(at.warning))
    assert sreq.output_text == preq.output_text  # greedy: identical output
    assert H.metric(at, "Accepted / drafted") == f"{sreq.spec_num_accepted_tokens} / {sreq.spec_num_draft_tokens}"
    assert sreq.spec_num_draft_tokens > 0
    specs = H.plotly_specs(at)
    theory = next(s for s in specs if s["layout"]["title"]["text"].startswith("tokens per target pass"))
    meas = next(t for t in theory["data"] if t.get("name", "").startswith("measured"))
    # at the passes' mean draft length: 3, less where the last passes near max_tokens drafted fewer
    assert meas["x"] == [pytest.approx(sreq.spec_num_draft_tokens / sreq.spec_num_drafts)] and meas["x"][0] <= 3
    assert meas["y"][0] == pytest.approx(1 + sreq.spec_num_accepted_tokens / sreq.spec_num_drafts)
    assert "tok-accepted" in H.html(at) or "tok-replaced" in H.html(at)
    # the tick timeline: scrubbing back shows only the tokens produced by then
    ticks = sorted({p.step for p in sreq.history} | {t.step for t in sreq.tokens})
    first_tok = min(t.step for t in sreq.tokens)
    at.select_slider(key="spec_tick").set_value(first_tok).run()
    H.no_exception(at)
    n = sum(1 for t in sreq.tokens if t.step <= first_tok)
    assert any(c.value.startswith(f"Step {first_tok}:") for c in at.caption)
    assert at.select_slider(key="spec_tick").options == [str(t) for t in ticks]
    assert 1 <= n < sreq.output_len
    _restore_default_engine()


def test_speculative_page_watch_mode_evicts_mid_run(app_test):
    """Watch mode: one speculative run on a private engine, evicted after 6 tokens; the page shows
    the eviction, the recomputed positions and the drop in the growth chart, and that greedy output
    matched plain decoding."""
    from ui.widgets import engine_access as ea
    from ui.widgets import room

    at = app_test()
    at.switch_page("pages/speculative.py")
    at.run()
    at.selectbox(key="spec_drafter").select("self-draft: int8 copy")
    at.slider(key="spec_max_tokens").set_value(24)
    at.radio(key="spec_mode").set_value("Watch live (evict during the run)")
    at.run()
    H.no_exception(at)
    at.number_input(key="spec_evict_after").set_value(6)
    gen = ea.shared_engine().generation
    at.button(key="spec_run").click().run()
    H.no_exception(at)
    assert ea.shared_engine().generation == gen
    run = room.room().get(at.query_params["run"])
    assert run is not None and run.kind == "spec-watch" and run.status == "done", run
    res = run.result
    assert len(res.evictions) == 1 and res.evictions[0].trigger == "after 6 tokens"
    assert res.matches_plain is True
    assert H.metric(at, "Evictions") == "1"
    assert any("token-for-token the plain" in m.value for m in at.success)
    html = H.html(at)
    assert "tok-evicted" in html and f"prompt: {res.request.prompt_len} tokens recomputed" in html
    assert any(c.value.startswith(f"Evicted after engine step {res.evictions[0].step}") for c in at.caption)
    growth = next(s for s in H.plotly_specs(at) if "cache growth" in s["layout"]["title"]["text"])
    assert any("evicted" in a.get("text", "") for a in growth["layout"]["annotations"])
    at.radio(key="spec_mode").set_value("Measure vs plain").run()  # leave the page as the other tests expect it
    _restore_default_engine()


def test_speculative_page_sampling_shows_p_and_q_per_draft(app_test):
    """Temperature > 0: rejection sampling; every judged draft's p, q, min(1, p/q) and draw u are
    in the table and in the token chips' tooltips."""
    from ui.widgets import room

    at = app_test()
    at.switch_page("pages/speculative.py")
    at.run()
    at.selectbox(key="spec_drafter").select("self-draft: int8 copy")
    at.slider(key="spec_max_tokens").set_value(24)
    at.slider(key="spec_temperature").set_value(0.3)
    at.run()
    at.button(key="spec_run").click().run()
    H.no_exception(at)
    sreq = room.room().get(at.query_params["run"]).result.spec
    judged = [t for t in sreq.tokens if t.kind in ("accepted", "replaced")]
    assert judged and all(t.p is not None for t in judged)
    assert any(m.value == "**Rejection sampling, draft by draft**" for m in at.markdown)
    table = next(d.value for d in at.dataframe if "verdict" in d.value.columns)
    assert len(table) == len(judged)
    assert list(table["verdict"]) == ["accepted" if t.kind == "accepted" else "rejected" for t in judged]
    assert list(table["p (target)"]) == [round(t.p, 4) for t in judged]
    assert "draft q = " in H.html(at) and "drew u = " in H.html(at)
    at.slider(key="spec_temperature").set_value(0.0).run()
    _restore_default_engine()


def test_speculative_page_draft_model_that_cannot_load_is_a_clear_error(app_test):
    at = app_test()
    at.switch_page("pages/speculative.py")
    at.run()
    at.selectbox(key="spec_drafter").select("draft model")
    at.run()
    assert at.text_input(key="spec_draft_model").value == "tiny"  # the offline poor drafter is offered
    at.text_input(key="spec_draft_model").input("/nonexistent/draft-model")
    at.slider(key="spec_k").set_value(16)
    at.button(key="spec_run").click().run()
    H.no_exception(at)
    assert any("The comparison failed" in e.value and "/nonexistent/draft-model" in e.value for e in at.error), [
        e.value for e in at.error
    ]
    assert H.engine().snapshot().info.speculative is None or "draft_model" not in H.engine().snapshot().info.speculative
