"""ui/figures/prefix_tree.py: KV events -> the prefix cache as a tree of block-hash chains."""

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.observe.kv_event_wire import AllBlocksCleared, BlockRemoved, BlockStored, apply_events, decode_batch
from tests.attach_stubs import demo_batches
from ui.figures import prefix_tree as P

A = list(range(100, 108))
B = list(range(100, 104)) + [7, 7, 7, 7]


def _tree(wire="current"):
    t = P.PrefixTree()
    for i, payload in enumerate(demo_batches(wire, A, B, 4)):
        t.apply(decode_batch(payload).events, t=float(i))
    return t


def test_chains_branch_and_evictions_prune():
    t = P.PrefixTree()
    batches = [decode_batch(p).events for p in demo_batches("legacy", A, B, 4)]
    t.apply(batches[0] + batches[1], t=0.0)
    assert t.hashes() == {1, 2, 3} and t.nodes[1].children == {2, 3}
    assert t.nodes[2].tokens == tuple(A[4:8]) and t.nodes[3].tokens == (7, 7, 7, 7)
    assert t.reuse() == {1: 1, 2: 0, 3: 0} and t.chains() == 2
    t.apply(batches[2], t=1.0)
    assert t.hashes() == {1, 3} and t.reuse() == {1: 0, 3: 0} and t.removed == 1
    assert t.hashes() == _tree("current").hashes()


def test_repeat_reports_count_as_reuse_and_orphans_and_clear():
    t = _tree()
    t.apply([BlockStored([1], None, A[:4], 4)], t=5.0)  # vLLM's kv_cache_report_mode="full" re-report
    assert t.reuse()[1] == 1 and t.nodes[1].stored_at == 0.0
    t.apply([BlockRemoved([1])], t=6.0)  # the parent goes first: 3 is an orphan
    assert t.roots() == [3]
    fig = P.tree_figure(t, now=10.0)
    assert "orphans" in fig.data[0].ids and fig.data[0].parents[list(fig.data[0].ids).index("orphans")] == "cache"
    t.apply([AllBlocksCleared()], t=7.0)
    assert len(t) == 0 and t.cleared == 1


def test_figure_colours_by_age_or_reuse_and_escapes_token_text():
    t = _tree()
    fig = P.tree_figure(t, now=4.0, color_by="age", decode=lambda ids: "<script>x</script>" if 7 in ids else "ok")
    d = fig.data[0]
    ids = list(d.ids)
    assert ids[0] == "cache" and set(ids[1:]) == {P.hash_label(1), P.hash_label(3)}
    assert list(d.marker.colors) == [0.0, 4.0, 3.0]  # ages: stored at t=0 and t=1
    label3 = d.labels[ids.index(P.hash_label(3))]
    assert "<script>" not in label3 and "&lt;script&gt;" in label3
    assert all("<script>" not in h for h in d.hovertext)
    fig = P.tree_figure(t, now=4.0, color_by="reuse")
    assert list(fig.data[0].marker.colors) == [0.0, 0.0, 0.0]


events = st.lists(
    st.one_of(
        st.builds(
            lambda hs, p: BlockStored(hs, p, [], 4),
            st.lists(st.integers(0, 30), min_size=1, max_size=3),
            st.none() | st.integers(0, 30),
        ),
        st.builds(lambda hs: BlockRemoved(hs), st.lists(st.integers(0, 30), min_size=1, max_size=3)),
        st.just(AllBlocksCleared()),
    ),
    max_size=40,
)


@settings(max_examples=100, deadline=None)
@given(events)
def test_tree_holds_exactly_the_cached_set(evs):
    t = P.PrefixTree()
    t.apply(evs, t=0.0)
    assert t.hashes() == apply_events(set(), evs)
    for h, n in t.nodes.items():
        assert all(c in t.nodes and t.nodes[c].parent == h for c in n.children)
