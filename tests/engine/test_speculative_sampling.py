"""The speculative verifier, unit-tested directly on synthetic distributions (no model).

Rejection sampling must leave the output distribution equal to the target's: we generate many
two-token continuations by speculating against position-dependent target rows p_pos (and draft
rows q_pos), with a fixed seed, and compare the joint distribution of the two emitted tokens with
p_0 ⊗ p_1 (chi-square at the 0.001 level, and a total-variation bound). A verifier that accepts
every draft fails the same test, so the test has power.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.observe.snapshot import ACCEPTED, BONUS, REPLACED
from engine.speculative import (
    Verdict,
    break_even_alpha,
    expected_tokens_per_pass,
    ngram_propose,
    verify_greedy,
    verify_sampling,
)

V = 8


def chi2_critical(df: int, z: float = 3.090232) -> float:
    """Upper 0.001 quantile of chi-square (Wilson–Hilferty; z = Φ⁻¹(0.999))."""
    a = 2 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def rows(seed: int, n: int, sharp: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(n, V, generator=g) * sharp, dim=-1)


def generate_two(
    p: torch.Tensor,
    q: torch.Tensor | None,
    point_drafts: list[int] | None,
    k: int,
    g: torch.Generator,
    verifier=verify_sampling,
) -> tuple[int, int]:
    """Emit tokens at positions 0 and 1 by speculating k drafts per pass; target row for
    position i is p[i] whatever the prefix (so the right answer is p[0] ⊗ p[1])."""
    out: list[int] = []
    while len(out) < 2:
        pos = len(out)
        drafts, qs = [], []
        for j in range(k):
            if q is None:
                drafts.append(point_drafts[pos + j])
            else:
                drafts.append(int(torch.multinomial(q[pos + j], 1, generator=g)))
                qs.append(q[pos + j])
        toks, marks, n_acc = verifier(drafts, p[pos : pos + k + 1], torch.stack(qs) if qs else None, g)
        assert len(toks) == n_acc + 1 and len(marks) == len(toks)
        out.extend(toks)
    return out[0], out[1]


def joint_counts(n: int, **kw) -> torch.Tensor:
    c = torch.zeros(V, V)
    for _ in range(n):
        a, b = generate_two(**kw)
        c[a, b] += 1
    return c


def chi2_and_tv(counts: torch.Tensor, expected_p: torch.Tensor) -> tuple[float, float]:
    n = counts.sum()
    e = expected_p * n
    chi2 = float(((counts - e) ** 2 / e).sum())
    tv = float((counts / n - expected_p).abs().sum() / 2)
    return chi2, tv


N = 12000


@pytest.mark.parametrize("k", [1, 3])
def test_rejection_sampling_matches_target_with_draft_distribution(k):
    p = rows(1, 2 + k, 1.0)
    q = rows(2, 2 + k, 1.5)  # a deliberately different draft
    g = torch.Generator().manual_seed(1234 + k)
    counts = joint_counts(N, p=p, q=q, point_drafts=None, k=k, g=g)
    expected = torch.outer(p[0], p[1])
    chi2, tv = chi2_and_tv(counts, expected)
    assert chi2 < chi2_critical(V * V - 1), chi2
    assert tv < 0.04, tv
    # marginals too (7 degrees of freedom each)
    for axis, row in ((1, p[0]), (0, p[1])):
        c1, _ = chi2_and_tv(counts.sum(axis), row)
        assert c1 < chi2_critical(V - 1), (axis, c1)


def test_rejection_sampling_matches_target_with_point_mass_drafts():
    """n-gram drafts are deterministic: q is a point mass, accept with probability p(x), and on
    rejection sample from p with x removed."""
    k = 2
    p = rows(3, 2 + k, 1.0)
    drafts = [int(p[i].argmax()) for i in range(2 + k)]  # likely drafts, as a lookup would give
    drafts[1] = int(p[1].argmin())  # and one unlikely one
    g = torch.Generator().manual_seed(99)
    counts = joint_counts(N, p=p, q=None, point_drafts=drafts, k=k, g=g)
    chi2, tv = chi2_and_tv(counts, torch.outer(p[0], p[1]))
    assert chi2 < chi2_critical(V * V - 1), chi2
    assert tv < 0.04, tv


def test_the_statistical_test_has_power():
    """Accepting every draft (ignoring p) must fail the same test by a wide margin."""

    def accept_all(drafts, p, q, g):
        toks = list(drafts) + [int(torch.multinomial(p[len(drafts)], 1, generator=g))]
        return toks, [ACCEPTED] * len(drafts) + [BONUS], len(drafts)

    k = 1
    p = rows(1, 2 + k, 1.0)
    q = rows(2, 2 + k, 1.5)
    g = torch.Generator().manual_seed(7)
    counts = joint_counts(3000, p=p, q=q, point_drafts=None, k=k, g=g, verifier=accept_all)
    chi2, _ = chi2_and_tv(counts, torch.outer(p[0], p[1]))
    assert chi2 > 5 * chi2_critical(V * V - 1)


def test_sampling_is_reproducible_with_the_same_seed():
    p = rows(5, 4, 1.0)
    q = rows(6, 3, 1.0)
    a = [verify_sampling([1, 2, 3], p, q, torch.Generator().manual_seed(s)) for s in range(20)]
    b = [verify_sampling([1, 2, 3], p, q, torch.Generator().manual_seed(s)) for s in range(20)]
    assert a == b


def test_rejected_token_never_reemitted_for_point_mass():
    """With q a point mass on x, the replacement is drawn from p with x removed."""
    p = torch.full((2, V), 1 / V)
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        toks, marks, n_acc = verify_sampling([4], p, None, g)
        if n_acc == 0:
            assert toks[0] != 4 and marks[0][:2] == (REPLACED, 4)


def test_verify_greedy_cases():
    logits = torch.full((4, V), -1.0)
    for i, t in enumerate([3, 5, 1, 7]):
        logits[i, t] = 2.0
    assert verify_greedy([3, 5, 1], logits) == ([3, 5, 1, 7], [Verdict(ACCEPTED)] * 3 + [Verdict(BONUS)], 3)
    assert verify_greedy([3, 6, 1], logits) == ([3, 5], [Verdict(ACCEPTED), Verdict(REPLACED, 6)], 1)
    assert verify_greedy([0], logits[:2]) == ([3], [Verdict(REPLACED, 0)], 0)
    # the output processor hands over the rows' argmax it computed for the whole batch (numpy's on
    # CPU): the same verdicts, ties to the first maximum as torch.argmax
    ties = logits.clone()
    ties[1, 2] = 2.0  # row 1: ids 2 and 5 share the maximum; the first wins
    ids = ties.numpy().argmax(-1).tolist()
    assert ids == ties.argmax(-1).tolist() == [3, 2, 1, 7]
    for drafts in ([3, 5, 1], [3, 2, 1], [3, 2, 0], [9]):
        n = len(drafts) + 1
        assert verify_greedy(drafts, ties[:n], ids[:n]) == verify_greedy(drafts, ties[:n])


def test_ngram_lookup():
    toks = [1, 2, 3, 4, 9, 9, 1, 2, 3, 5, 6, 7, 1, 2, 3]
    # longest suffix n-gram [1,2,3] (n=3): most recent earlier occurrence is at 6 -> 5, 6, 7, 1
    assert ngram_propose(toks, 4, 1, 3) == [5, 6, 7, 1]
    assert ngram_propose(toks, 2, 1, 3) == [5, 6]
    assert ngram_propose([1, 2, 3, 4], 3, 1, 3) == []
    # the match sits right before the end: the copy continues from its own output (a loop)
    assert ngram_propose([7, 8, 7], 3, 1, 1) == [8, 7, 8]
    assert ngram_propose([5, 6, 5, 6, 5], 5, 1, 3) == [6, 5, 6, 5, 6]
    assert ngram_propose([5], 3, 1, 3) == []
    # min n respected: only a 1-gram match exists
    assert ngram_propose([4, 1, 9, 8, 1], 2, 2, 3) == []
    # match_bound: at most (match length + 1) tokens; the match is measured past n_max, backwards
    assert ngram_propose([4, 1, 9, 8, 1], 4, 1, 3, match_bound=True) == [9, 8]
    assert ngram_propose(toks, 6, 1, 3, match_bound=True) == [5, 6, 7, 1]  # 3 matched: 4 drafted
    assert ngram_propose([5, 6, 7, 8, 9, 0, 5, 6, 7, 8, 9], 6, 1, 1, match_bound=True) == [0, 5, 6, 7, 8, 9]
    assert ngram_propose([5, 6, 7, 8, 9, 0, 5, 6, 7, 8, 9], 3, 1, 1, match_bound=True) == [0, 5, 6]
    assert ngram_propose([1, 2, 3, 4], 3, 1, 3, match_bound=True) == []


def _ngram_by_definition(tokens, k, n_min, n_max, match_bound=False):
    """Prompt lookup spelled out position by position: the longest n (n_max down to n_min) whose
    suffix n-gram occurs earlier with something after it, the latest such start, then k tokens
    copied on from there, the copy reading its own output once it passes the end; match_bound:
    min(k, m + 1) tokens, m the longest common suffix of the context and the tokens up to the
    match's end."""
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        starts = [i for i in range(L - n) if tokens[i : i + n] == tokens[L - n :]]
        if starts:
            end = starts[-1] + n
            m = max(j for j in range(end + 1) if tokens[end - j : end] == tokens[L - j :])
            ext = list(tokens)
            for j in range(min(k, m + 1) if match_bound else k):
                ext.append(ext[end + j])
            return ext[L:]
    return []


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.integers(0, 4), min_size=1, max_size=60),
    st.integers(1, 6),
    st.integers(1, 3),
    st.integers(0, 2),
    st.booleans(),
)
def test_ngram_lookup_matches_its_definition(tokens, k, n_min, extra, bound):
    # a small alphabet, so matches at every n, overlapping ones and loops are common
    got = ngram_propose(tokens, k, n_min, n_min + extra, match_bound=bound)
    assert got == _ngram_by_definition(tokens, k, n_min, n_min + extra, match_bound=bound)


def test_expected_tokens_and_break_even():
    assert expected_tokens_per_pass(0.0, 4) == 1.0
    assert expected_tokens_per_pass(1.0, 4) == 5.0
    assert abs(expected_tokens_per_pass(0.5, 2) - 1.75) < 1e-12
    a = break_even_alpha(1.75, 2)
    assert abs(a - 0.5) < 1e-9
    assert break_even_alpha(0.9, 4) == 0.0
    assert break_even_alpha(5.0, 4) is None


def test_verdicts_carry_the_numbers_behind_each_decision():
    """Each accepted / replaced verdict holds p(x), q(x) of its draft and the draw u, with
    accepted iff u * q < p; a bonus holds the target's probability of the bonus token."""
    p = rows(11, 4, 1.0)
    q = rows(12, 3, 0.5)
    seen = set()
    for s in range(200):
        drafts = [1, 2, 3]
        toks, marks, n_acc = verify_sampling(drafts, p, q, torch.Generator().manual_seed(s))
        for j, m in enumerate(marks):
            seen.add(m.kind)
            if m.kind == BONUS:
                assert m.p == pytest.approx(float(p[j, toks[j]])) and m.q is None and m.u is None
                continue
            assert m.p == pytest.approx(float(p[j, drafts[j]])) and m.q == pytest.approx(float(q[j, drafts[j]]))
            assert 0.0 <= m.u < 1.0
            assert (m.u * m.q < m.p) == (m.kind == ACCEPTED)
            if m.kind == REPLACED:
                assert m.rejected_id == drafts[j]
    assert seen == {ACCEPTED, REPLACED, BONUS}
    # deterministic drafts (q = None): q is a point mass, recorded as 1.0
    _, marks, _ = verify_sampling([4], p[:2], None, torch.Generator().manual_seed(0))
    assert marks[0].q == 1.0
