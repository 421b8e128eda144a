"""A tenant secret end to end (issue 17): an engine whose L3 URL names its tenant's secret
never matches pages someone without the secret wrote under its keys (keys are computable
from tokens: the forger needs nothing else). They are misses, counted as refused pages."""

from __future__ import annotations

import torch

from tests.support.caches import NS, put, read_pages, tokens_for


def test_an_engine_with_a_secret_never_matches_forged_pages(cache_factory, tmp_path):
    directory = tmp_path / "l3"
    secret = tmp_path / "team-a.secret"
    secret.write_text("team-a: a long random secret for the test\n")
    plain_url = f"file://{directory}?capacity=1GiB"
    signed_url = f"{plain_url}&secret_file={secret}"  # or the config's l3.secret_file
    tokens = tokens_for(7, 3)

    forger = cache_factory(write_policy="write_through", l3_url=plain_url)
    put(forger, tokens, seed=66)  # the attacker's bytes, under the keys of a known prompt
    forger.flush()

    victim = cache_factory(
        l3_url=plain_url, l3_secret_file=str(secret), prefetch_policy="wait_complete"
    )
    match = victim.match(tokens, NS)
    assert match.num_tokens == 0  # nothing the forger wrote is served
    victim.release(match)
    assert victim.stats().l3_corrupt_pages == 3  # refused, counted (as forged by the backend)
    assert victim.executor.l3_stats().num_forged == 3

    owner = cache_factory(write_policy="write_through", l3_url=signed_url)
    values = put(owner, tokens, seed=7)  # the tenant's own pages replace them
    owner.flush()
    reader = cache_factory(l3_url=signed_url, prefetch_policy="wait_complete")
    match = reader.match(tokens, NS)
    assert match.num_l3_pages == 3
    for layer in range(reader.layout.num_layers):
        reader.wait_layer(match, layer)
    assert torch.equal(read_pages(reader, match.device_page_ids), values)
    reader.release(match)
