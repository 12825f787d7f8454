"""Speculative views and growth/phase figures carry the numbers they are given."""

import dataclasses

import pytest

from tests.factories import hist, request, tok
from ui.figures import growth, spec


@pytest.mark.parametrize(
    "alpha,k,expected", [(0.0, 4, 1.0), (1.0, 4, 5.0), (0.5, 1, 1.5), (0.8, 4, 3.3616), (0.7, 0, 1.0)]
)
def test_expected_tokens_per_pass(alpha, k, expected):
    assert spec.expected_tokens_per_pass(alpha, k) == pytest.approx(expected, abs=1e-4)


def test_expected_is_never_below_one_and_grows_with_k():
    for a in (0.05, 0.3, 0.6, 0.9, 0.99):
        vals = [spec.expected_tokens_per_pass(a, k) for k in range(12)]
        assert vals[0] == pytest.approx(1.0)
        assert all(v >= 1 for v in vals)
        assert all(b > a_ for a_, b in zip(vals, vals[1:]))
        # the seed's point: returns diminish, each extra draft token adds alpha^k
        diffs = [b - a_ for a_, b in zip(vals, vals[1:])]
        assert diffs == pytest.approx([a ** (k + 1) for k in range(11)])


def test_bad_arguments():
    with pytest.raises(ValueError):
        spec.expected_tokens_per_pass(1.2, 3)
    with pytest.raises(ValueError):
        spec.expected_tokens_per_pass(0.5, -1)


def _spec_tokens():
    # step 1: prefill token (plain). step 2: 2 accepted then rejected. step 3: 3 accepted + bonus.
    # step 4: first draft rejected. step 5: no draft (plain).
    return [
        tok(1, "A", "plain", 1),
        tok(2, "b", "accepted", 2),
        tok(3, "c", "accepted", 2),
        tok(4, "D", "replaced", 2, rejected_text="x"),
        tok(5, "e", "accepted", 3),
        tok(6, "f", "accepted", 3),
        tok(7, "g", "accepted", 3),
        tok(8, "H", "bonus", 3),
        tok(9, "I", "replaced", 4, rejected_text="y"),
        tok(10, "J", "plain", 5),
    ]


def test_position_counts_from_token_marks():
    pc = spec.position_counts(_spec_tokens())
    assert pc.accepted == (2, 2, 1)
    assert pc.reached == (3, 2, 2)
    assert pc.verify_passes == 3 and pc.plain_passes == 2
    assert pc.alpha == pytest.approx(5 / 7)
    assert pc.rates == pytest.approx((2 / 3, 1.0, 0.5))


def test_request_summary_uses_vllm_definitions():
    toks = _spec_tokens()
    req = request(
        "r", output_len=len(toks), tokens=toks, spec_num_drafts=3, spec_num_draft_tokens=12, spec_num_accepted_tokens=5
    )
    s = spec.request_summary(req)
    assert s.acceptance_rate == pytest.approx(5 / 12)
    assert s.mean_acceptance_length == pytest.approx(1 + 5 / 3)
    assert s.target_passes == 10 - 5 == 5  # 1 prefill + 3 verify + 1 plain
    assert s.tokens_per_target_pass == pytest.approx(2.0)
    assert s.alpha == pytest.approx(5 / 7)


def test_theory_figure_carries_curve_and_measured_point():
    fig = spec.theory_figure(0.8, 4, 2.9, k_max=8)
    main = [t for t in fig.data if t.name and t.name.startswith("theory at measured")][0]
    assert list(main.x) == list(range(9))
    assert main.y[4] == pytest.approx(3.3616, abs=1e-4)
    meas = [t for t in fig.data if t.name and t.name.startswith("measured")][0]
    assert list(meas.x) == [4] and list(meas.y) == [2.9]
    names = [t.name for t in fig.data]
    assert "theory at k = 4: 3.36" in names
    # drafts shorter than k (the n-gram drafter after a short match): the point sits at the mean
    fig = spec.theory_figure(0.8, 3.5, 2.9, k_max=8)
    assert list([t for t in fig.data if t.name.startswith("measured")][0].x) == [3.5]
    assert f"theory at the mean draft length 3.50: {(1 - 0.8**4.5) / 0.2:.2f}" in [t.name for t in fig.data]
    assert "theory at k = 4: 3.36" in [t.name for t in spec.theory_figure(0.8, 4.0, 2.9).data]
    # without a measurement yet: references only, no crash
    fig = spec.theory_figure(None, 4, None)
    assert all(t.name.startswith("α =") for t in fig.data)


def test_position_figure():
    pc = spec.position_counts(_spec_tokens())
    fig = spec.position_figure(pc)
    bar = fig.data[0]
    assert list(bar.x) == ["1", "2", "3"]
    assert list(bar.y) == pytest.approx([2 / 3, 1.0, 0.5])
    assert list(bar.text) == ["2/3", "2/2", "1/2"]
    assert spec.position_figure(spec.position_counts([])).layout.annotations


def test_costs_and_speedup():
    c = spec.Costs(
        plain_per_token=0.020,
        spec_per_token=0.010,
        draft_per_pass=0.001,
        verify_per_pass=0.024,
        plain_e2e=1.5,
        spec_e2e=1.0,
    )
    assert c.speedup == pytest.approx(1.5)
    assert c.decode_speedup == pytest.approx(2.0)
    fig = spec.costs_figure(c)
    ys = {t.name: t.y[0] for t in fig.data}
    assert ys["plain decode / token"] == pytest.approx(20.0)
    assert ys["verify / pass"] == pytest.approx(24.0)
    assert "1.50×" in fig.layout.title.text
    assert spec.Costs().speedup is None


def test_measured_costs_from_the_runs_and_their_verify_events():
    from engine.observe.trace_events import Event

    plain = request("p", state="finished", output_len=11, arrival_time=0.0, first_token_time=0.5, finish_time=1.5)
    sped = request("s", state="finished", output_len=11, arrival_time=0.0, first_token_time=0.5, finish_time=1.0)
    evs = [
        Event(seq=1, step=3, time=0.6, kind="verify", request_id="s", data={"draft_time_s": 0.002, "verify_ms": 30}),
        Event(seq=2, step=4, time=0.7, kind="verify", request_id="s", data={"draft_ms": 4.0, "verify_time_s": 0.01}),
        Event(seq=3, step=5, time=0.8, kind="verify", request_id="s", data={"draft_time_s": "n/a"}),
    ]
    c = spec.measured_costs(sped, plain, evs)
    assert c.plain_per_token == pytest.approx(0.1) and c.spec_per_token == pytest.approx(0.05)
    assert c.draft_per_pass == pytest.approx(0.003) and c.verify_per_pass == pytest.approx(0.02)
    assert (c.plain_e2e, c.spec_e2e) == (1.5, 1.0) and c.speedup == pytest.approx(1.5)
    running = request("r", output_len=1, first_token_time=0.5)
    assert spec.measured_costs(running, None, []) == spec.Costs()


def _growth_request():
    h = [
        hist(100, 0, 0, "waiting"),
        hist(101, 16, 4, "prefill"),
        hist(102, 17, 5, "decode"),
        hist(103, 18, 5, "decode"),
        hist(104, 0, 0, "preempted"),
        hist(105, 19, 5, "prefill"),
        hist(106, 20, 5, "decode"),
    ]
    return request(
        "g",
        prompt_len=16,
        output_len=4,
        history=h,
        arrival_time=10.0,
        first_token_time=10.25,
        finish_time=11.0,
        state="finished",
    )


def test_growth_figure_numbers():
    req = _growth_request()
    fig = growth.growth_figure(req, block_size=4, evict_steps=(104,))
    tokens = [t for t in fig.data if t.name == "tokens in cache"][0]
    slots = [t for t in fig.data if t.name.startswith("slots allocated")][0]
    byts = [t for t in fig.data if t.name == "K/V bytes"][0]
    assert list(tokens.x) == [0, 1, 2, 3, 4, 4, 5, 6]  # the evict event's drop follows step 104's point
    assert list(tokens.y) == [0, 16, 17, 18, 0, 0, 19, 20]
    assert list(slots.y) == [0, 16, 20, 20, 0, 0, 20, 20]
    assert list(byts.y) == [0, 16000, 17000, 18000, 0, 0, 19000, 20000]
    assert any("evicted" in (a.text or "") for a in fig.layout.annotations)


def test_eviction_drop_is_inserted_after_that_steps_point():
    req = request(
        "e",
        history=[
            hist(1, 10, 3, "prefill"),
            hist(2, 11, 3, "decode"),
            hist(3, 12, 3, "decode"),
            hist(5, 13, 4, "prefill"),
            hist(6, 14, 4, "decode"),
        ],
    )
    fig = growth.growth_figure(req, block_size=4, evict_steps=(3,))
    tokens = [t for t in fig.data if t.name == "tokens in cache"][0]
    assert list(tokens.x) == [0, 1, 2, 2, 4, 5]
    assert list(tokens.y) == [10, 11, 12, 0, 13, 14]


def test_phase_segments_and_stats():
    req = _growth_request()
    assert growth.phase_segments(req.history) == [
        ("waiting", 0, 0),
        ("prefill", 1, 1),
        ("decode", 2, 3),
        ("preempted", 4, 4),
        ("prefill", 5, 5),
        ("decode", 6, 6),
    ]
    st = growth.phase_stats(req)
    assert st.ttft_s == pytest.approx(0.25)
    assert st.decode_tok_s == pytest.approx(3 / 0.75)
    assert st.e2e_s == pytest.approx(1.0)
    assert st.prefill_steps == 2 and st.decode_steps == 3
    fig = growth.phase_figure(req, stats=st)
    bars = [(t.name, t.base[0], t.x[0]) for t in fig.data]
    assert bars[2] == ("decode", 1.5, 2)
    assert "2 prefill step(s)" in fig.layout.title.text


def test_running_request_stats_use_now():
    req = request("r", output_len=5, arrival_time=0.0, first_token_time=0.5, finish_time=None)
    st = growth.phase_stats(req, now=1.5)
    assert st.decode_tok_s == pytest.approx(4.0) and st.e2e_s is None
    assert growth.phase_stats(request("w", output_len=0)).ttft_s is None


def test_summary_line_is_escaped():
    req = request("<script>x</script>", output_len=1)
    line = growth.summary_line(req, growth.phase_stats(req))
    assert "<script>" not in line and "&lt;script&gt;" in line


def test_decode_figure_is_one_over_tpot():
    """The Playground's "Decode" is rates.decode_rate: up to the newest token, as TPOT ends."""
    from engine.observe import rates

    req = request("d", output_len=5, arrival_time=0.0, first_token_time=0.5, finish_time=3.0)
    req = dataclasses.replace(req, last_token_time=1.5)
    assert growth.phase_stats(req).decode_tok_s == pytest.approx(4.0)
    assert rates.decode_rate(0.5, 1.5, 5) == pytest.approx(1 / rates.tpot(0.5, [1.0, 1.5], 5))
    assert rates.decode_rate(0.5, 0.5, 5) is None and rates.decode_rate(0.5, 1.0, 1) is None
