"""`ask_l3_again`: the schedulers' rule for a waiting request's L3 lookup."""

from __future__ import annotations

from hicache.match import ask_l3_again


def test_a_lookup_stands_until_it_is_ask_again_s_old():
    assert ask_l3_again(None, 5.0, 0.5)  # never asked
    assert not ask_l3_again(5.0, 5.0, 0.5)
    assert not ask_l3_again(5.0, 5.49, 0.5)
    assert ask_l3_again(5.0, 5.5, 0.5)
    assert ask_l3_again(5.0, 5.0, 0.0)  # 0: every time
