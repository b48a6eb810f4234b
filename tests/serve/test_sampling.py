"""serve.sampling: the draw and top-p against their definitions (the engine tests cover seeds and penalties)."""

import torch

from serve.sampling import DRAW_BLOCK, SamplerState, SamplingParams, _draw, _top_p


def test_draws_follow_the_probabilities_across_blocks_and_never_pick_zero_mass():
    n = 3 * DRAW_BLOCK + 17  # full blocks and a tail
    probs = torch.zeros(n)
    mass = {0: 1.0, 5: 3.0, DRAW_BLOCK - 1: 2.0, DRAW_BLOCK: 2.0, 2 * DRAW_BLOCK + 3: 1.0, n - 1: 1.0}
    for i, m in mass.items():
        probs[i] = m
    g = torch.Generator().manual_seed(0)
    draws = 20000
    counts: dict[int, int] = {}
    for _ in range(draws):
        i = _draw(probs, g)
        counts[i] = counts.get(i, 0) + 1
    assert set(counts) == set(mass)  # every entry with mass, none without
    total = sum(mass.values())
    for i, m in mass.items():
        p = m / total
        sd = (draws * p * (1 - p)) ** 0.5
        assert abs(counts[i] - draws * p) < 5 * sd, (i, counts[i], draws * p)


def test_draw_of_no_mass_is_none():
    assert _draw(torch.zeros(10), torch.Generator().manual_seed(0)) is None


def _top_p_by_sort(probs: torch.Tensor, top_p: float) -> set[int]:
    """The definition, over a full sort: entries whose mass before them is at most top_p of the total."""
    sp, si = torch.sort(probs, descending=True)
    before = torch.cumsum(sp.double(), 0) - sp.double()
    return set(si[before <= top_p * float(probs.sum())].tolist())


def test_top_p_equals_the_full_sort_also_when_the_prefix_is_longer_than_the_first_topk():
    g = torch.Generator().manual_seed(1)
    for n, scale in ((50, 2.0), (5000, 0.1), (5000, 3.0), (70000, 0.01)):  # 0.1 and 0.01: flat, long prefixes
        probs = torch.softmax(torch.randn(n, generator=g) * scale, 0)
        for top_p in (0.1, 0.5, 0.9, 0.999):
            sp, si = _top_p(probs, top_p)
            assert set(si.tolist()) == _top_p_by_sort(probs, top_p), (n, scale, top_p)
            assert torch.equal(sp, probs[si]) and bool((sp[:-1] >= sp[1:]).all())


def test_sampled_tokens_stay_in_the_restricted_support_of_a_large_vocabulary():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(262144, generator=g) * 4
    ranked = torch.argsort(logits, descending=True)
    for kw, allowed in (({"top_k": 5}, set(ranked[:5].tolist())),
                        ({"top_p": 0.5, "temperature": 1.0},
                         _top_p_by_sort(torch.softmax(logits, 0), 0.5))):  # 38 tokens
        st = SamplerState(SamplingParams(max_tokens=1, seed=0, **kw), [], logits.numel())
        got = {st.sample(logits) for _ in range(100)}
        assert got <= allowed and len(got) > 1, kw
