"""The packet-size section's figures and rows (ui/figures/side_channel.py): pure functions of a
packet_channel result; the numbers drawn are the result's."""

from engine.lab import packet_channel as pc
from ui.figures import side_channel as F


def _result() -> pc.PacketResult:
    sizes = ((3, 5, 2), (4, 4, 4))
    trials = []
    for r, d in enumerate(pc.DEFENCES):
        recs = (203, 205, 232) if d == "none" else (530, 530, 530)
        guess = 0 if d in ("none", "coalesce") else 1
        trials.append(pc.Trial(d, r, 0, guess, 3, 3, 3 if d == "none" else 0, 1, 6.0, 900, 0.1, 0.5, True, recs))
    return pc.PacketResult(tuple(trials), 2, 3, 200, 30, "TLS_AES_256_GCM_SHA384", "tiny", ("a?", "b?"), sizes)


def test_packet_figures_draw_the_result():
    res = _result()
    sums = res.summaries()
    acc = F.packet_accuracy_figure(sums)
    bars = [t for t in acc.data if t.type == "bar"]
    assert list(bars[0].y) == [100 * s.accuracy for s in sums] == [100.0, 0.0, 100.0, 0.0]
    tr = F.packet_trace_figure(res)
    first_bar = next(t for t in tr.data if t.type == "bar")
    assert list(first_bar.y) == [3, 5, 2]  # the records less the overhead: the true token sizes
    rows = F.packet_rows(sums)
    assert rows[0]["answer guessed"] == "100% (chance 50%)"
    assert "×" in rows[1]["bytes per answer"] and rows[0]["trials"] == 1
