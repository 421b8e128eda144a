"""The verdict's extra runs, and what it concludes from them."""

from __future__ import annotations

import pytest

from hicache.simulate import simulate
from hicache.simulate.config import default_l1_bytes
from hicache.simulate.sweep import run_configs
from hicache.simulate.trace import ConversationWorkload, generate_conversations
from hicache.simulate.verdict import budget_per_month, build_verdict, plan_probes

TRACE = generate_conversations(ConversationWorkload(sessions=60, rate=4, think_s=5, seed=9))


def verdict_for(config):
    probes = plan_probes(config, TRACE)
    names = [name for name, probe in probes.items() if probe.config is not None]
    results = run_configs([probes[n].config for n in names], TRACE, jobs=1)
    base = simulate(config, TRACE)
    return (
        base,
        probes,
        build_verdict(config, TRACE, base, probes, dict(zip(names, results, strict=True))),
    )


def test_the_probes_spend_one_budget_in_each_tier(config_factory):
    config = config_factory(page_size=64, l1_pages=50, l2_pages=100, l3_pages=400)
    probes = plan_probes(config, TRACE)
    budget = budget_per_month(config)
    assert budget == 0.02 * config.monthly_cost()["gpus"]
    for tier in ("l1", "l2", "l3"):
        grown = probes[tier].config
        added_cost = sum(
            grown.monthly_cost()[t] - config.monthly_cost()[t] for t in ("l1", "l2", "l3")
        )
        assert added_cost == pytest.approx(budget) or tier == "l1"  # L1 stops at the HBM left
    assert probes["ceiling"].config.l1_pages * 64 >= TRACE.total_tokens
    assert probes["other_l3"].config.l3_bytes == 0  # shared L3 against none


def test_tiers_that_cannot_grow_say_why(
    config_factory,
):
    at_limit = config_factory(page_size=64, l2_pages=100)
    at_limit = at_limit.replace(
        l1_bytes=default_l1_bytes(at_limit.model, at_limit.hardware, 8), l2_bytes=0.0
    )
    probes = plan_probes(at_limit, TRACE)
    assert probes["l1"].config is None and "limit" in probes["l1"].note
    assert probes["l3"].config is None and "needs an L2" in probes["l3"].note
    assert probes["other_l3"].config is None


def test_one_l3_per_instance_is_compared_with_the_same_bytes_shared(config_factory):
    config = config_factory(
        page_size=64, l1_pages=20, l2_pages=40, l3_pages=300, num_instances=2, l3_shared=False
    )
    base, probes, verdict = verdict_for(config)
    other = probes["other_l3"].config
    assert other.l3_shared and other.l3_bytes == 2 * config.l3_bytes
    check = verdict.shared_l3
    assert check.l3_cost == 0  # the same bytes, in one store
    assert check.hit_rate_shared >= check.hit_rate_local
    assert check.local_l3_bytes == 2 * config.l3_bytes
    text = " ".join(verdict.lines)
    assert "an L3 each of" in text and "2 prefill instances" in text


def test_the_next_dollar_goes_where_it_returns_most(config_factory):
    config = config_factory(page_size=64, l1_pages=20, l2_pages=40, l3_pages=40)
    base, _, verdict = verdict_for(config)
    ranked = sorted(verdict.margins, key=lambda m: m.return_per_dollar, reverse=True)
    best = ranked[0]
    assert best.added_cost > 0
    line = next(line for line in verdict.lines if line.startswith("Next dollar"))
    if best.return_per_dollar >= 1:
        assert line.startswith(f"Next dollar: {best.tier.upper()}.")
    else:
        assert line.startswith("Next dollar: nowhere.")
    assert verdict.ceiling_hit_rate >= base.hit_rate


def test_one_instance_gets_no_disaggregation_verdict(config_factory):
    """With one prefill instance there is nothing to share: neither "pays off" nor not."""
    config = config_factory(page_size=64, l1_pages=20, l2_pages=40, l3_pages=300)
    _, _, verdict = verdict_for(config)
    line = next(line for line in verdict.lines if "disaggregation" in line)
    assert "not judged with one prefill instance" in line
    assert "pays off" not in line and "does not pay" not in line


def test_the_pd_handoff_is_decided_as_the_router_decides_it(config_factory, monkeypatch):
    """The P/D figures come from hicache.routing.needs_prefill on each request's match
    (the router's own decision): a request whose full pages are all cached hands nothing
    to decode; the others hand the pages they lacked. The verdict's GB/s is those pages."""
    import numpy as np

    from hicache.simulate import result

    lengths = np.array([129, 129, 200, 65])  # full pages a match can cover: 2, 2, 3, 1
    hits = np.array([[2, 0, 0], [0, 1, 0], [1, 1, 1], [0, 0, 0]])
    assert result._pd_handoff(lengths, hits, 64) == {"pd_prefills": 2, "pd_handoff_pages": 2}
    decided = []
    real = result.needs_prefill

    def spy(cached, num_pages):
        decided.append((cached, num_pages))
        return real(cached, num_pages)

    monkeypatch.setattr(result, "needs_prefill", spy)
    config = config_factory(page_size=64, l1_pages=20, l2_pages=40, l3_pages=300, num_instances=2)
    base, _, verdict = verdict_for(config)
    assert len(decided) >= TRACE.num_requests  # every request of every run
    check = verdict.shared_l3
    shared = base  # the base config shares its L3
    expected = shared.pd_handoff_pages * config.page_bytes / shared.duration_s / 2 / 1e9
    assert check.pd_gb_per_s == pytest.approx(expected)
    assert check.pd_direct_fraction == pytest.approx(1 - shared.pd_prefills / shared.requests)
    line = next(line for line in verdict.lines if "disaggregation" in line)
    assert "straight to decode" in line
