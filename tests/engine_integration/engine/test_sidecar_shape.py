"""The sidecar shape without torch: the one rule of a whole sidecar, and the keys a router
checks it by (engine/sidecar_shape.py)."""

from __future__ import annotations

import pytest

from engine_integration.engine.model.config import tiny_model_config
from engine_integration.engine.sidecar_shape import SidecarKeys, SidecarShape
from radix.keys import Namespace, encode_tokens, page_keys

PAGE = 4
# 2 windowed layers of 6, a 9-token window: a whole sidecar holds 2 pages of windowed KV
# (4 pieces: 1 cache page of 4 page layers); a delta of 1 page, 2 pieces (1 page too).
SHAPE = SidecarShape.of(
    tiny_model_config().replace(num_source_layers=6, windowed_layers=(0, 2), window_tokens=9),
    PAGE,
)
NAMESPACE = Namespace(model_id="m", layout="l")


def test_the_shape_of_an_interleaved_model_and_none_for_others():
    assert SHAPE == SidecarShape(
        page_size=PAGE, num_windowed_layers=2, num_page_layers=4, span_pages=2
    )
    assert SidecarShape.of(tiny_model_config(), PAGE) is None


def test_a_sidecar_is_whole_alone_or_as_a_delta_over_the_whole_one_up_its_path():
    def runs(held: set[tuple[int, int]], boundary: int) -> tuple[int, list]:
        asked = []

        def has(at: int, delta_pages: int) -> bool:
            asked.append((at, delta_pages))
            return (at, delta_pages) in held

        return SHAPE.whole_runs(boundary, has), asked

    assert runs({(12, 0)}, 12) == (1, [(12, 0)])
    assert runs({(12, 1), (8, 0)}, 12) == (2, [(12, 0), (12, 1), (8, 0)])
    assert runs({(12, 1)}, 12) == (0, [(12, 0), (12, 1), (8, 0)])  # a delta without its base
    assert runs(set(), 12) == (0, [(12, 0), (12, 1)])
    assert runs({(4, 1)}, 4)[0] == 0  # one page in: no room for a delta, only a whole one


def test_the_keys_of_a_sidecar_are_those_the_cache_indexes_its_path_under():
    tokens = encode_tokens(list(range(1, 6 * PAGE + 1)))
    keys = page_keys(tokens, NAMESPACE, PAGE)
    made = SidecarKeys(SHAPE, keys)
    for boundary, delta_pages in ((4, 0), (8, 0), (16, 1), (24, 0)):
        path = page_keys(SHAPE.tokens(tokens, boundary, delta_pages), NAMESPACE, PAGE)
        assert path[: boundary // PAGE] == keys[: boundary // PAGE]
        assert made.run(boundary, delta_pages) == path[boundary // PAGE :]
        assert made.run(boundary, delta_pages, 1) == path[boundary // PAGE :][:1]


def test_served_pages_is_the_deepest_boundary_whose_sidecar_is_all_held():
    tokens = encode_tokens(list(range(1, 6 * PAGE + 1)))
    keys = page_keys(tokens, NAMESPACE, PAGE)
    made = SidecarKeys(SHAPE, keys)
    held = set(keys)
    assert made.served_pages(6, held.__contains__) == 0  # pages, and no sidecar anywhere
    held |= set(made.run(8, 0))
    assert made.served_pages(6, held.__contains__) == 2
    held |= set(made.run(12, 1))  # a delta at 12 over the whole one at 8
    assert made.served_pages(6, held.__contains__) == 3
    assert made.served_pages(2, held.__contains__) == 2  # never past the pages asked about
    held |= set(made.run(24, 0))
    assert made.served_pages(6, held.__contains__) == 6
    held -= set(made.run(8, 0))  # the delta's base evicted: 12 is no longer whole
    assert made.served_pages(5, held.__contains__) == 0


def test_the_shape_round_trips_through_a_replicas_info_and_bad_fields_are_named():
    assert SidecarShape.from_info(SHAPE.to_info(), PAGE) == SHAPE
    with pytest.raises(ValueError, match="sidecar: expected an object"):
        SidecarShape.from_info([1, 2], PAGE)
    with pytest.raises(ValueError, match=r"sidecar.span_pages: expected an int in \[1, "):
        SidecarShape.from_info(SHAPE.to_info() | {"span_pages": 0}, PAGE)
    with pytest.raises(ValueError, match="sidecar.num_page_layers"):
        SidecarShape.from_info(SHAPE.to_info() | {"num_page_layers": "4"}, PAGE)
    with pytest.raises(ValueError, match="sidecar: a page size in"):
        SidecarShape.from_info(SHAPE.to_info(), 0)
