import pytest

from radix.errors import RadixError
from radix.keys import Namespace, page_keys
from radix.node import Tier
from radix.tree import RadixTree

NS = Namespace(model_id="test-model", layout="test-layout")

P = 4  # tokens per page in these tests


def seq(*pages: int, tail: int = 0) -> list[int]:
    """Tokens made of whole pages, page k being [k*10, k*10+1, ...]; `tail` extra tokens."""
    tokens = [page * 10 + j for page in pages for j in range(P)]
    return tokens + [999] * tail


@pytest.fixture
def tree():
    tree = RadixTree(page_size=P)
    yield tree
    tree.check_invariants()


def test_empty_tree_matches_nothing(tree):
    match = tree.match_prefix(seq(1, 2), NS)
    assert match.matched_pages == 0 and match.matched_tokens == 0
    assert match.device_page_ids == [] and match.l2_nodes == [] and match.l3_nodes == []


def test_insert_then_match_full_and_partial(tree):
    result = tree.insert(seq(1, 2, 3, tail=2), [10, 11, 12], NS)
    assert result.num_present_pages == 0 and result.num_new_pages == 3
    assert tree.num_pages(Tier.L1) == 3
    match = tree.match_prefix(seq(1, 2, 3, 4), NS)
    assert match.matched_pages == 3 and match.matched_tokens == 3 * P
    assert match.device_page_ids == [10, 11, 12]
    partial = tree.match_prefix(seq(1, 2, 7), NS)
    assert partial.device_page_ids == [10, 11]
    assert partial.last_node.num_pages == 2  # the run was split at the match's end
    assert tree.num_nodes == 2
    tree.check_invariants()


def test_match_inside_a_page_counts_whole_pages_only(tree):
    tree.insert(seq(1, 2), [0, 1], NS)
    tokens = seq(1, 2)
    tokens[P + 1] = 12345  # differs inside the second page
    assert tree.match_prefix(tokens, NS).matched_pages == 1
    assert tree.match_prefix(seq(1, tail=P - 1), NS).matched_pages == 1


def test_insert_reports_present_pages_and_duplicates(tree):
    tree.insert(seq(1, 2), [0, 1], NS)
    result = tree.insert(seq(1, 2, 3), [0, 7, 8], NS)
    assert result.num_present_pages == 2 and result.num_new_pages == 1
    assert result.duplicate_device_page_ids == [7]  # page 1 was already held under id 1
    assert tree.match_prefix(seq(1, 2, 3), NS).device_page_ids == [0, 1, 8]


def test_insert_needs_an_id_per_page(tree):
    with pytest.raises(RadixError, match="one device page id per full page"):
        tree.insert(seq(1, 2), [0], NS)


def test_divergent_branches_share_their_prefix(tree):
    tree.insert(seq(1, 2, 3), [0, 1, 2], NS)
    tree.insert(seq(1, 2, 5, 6), [0, 1, 3, 4], NS)
    assert tree.num_pages(Tier.L1) == 5
    assert tree.match_prefix(seq(1, 2, 5, 6), NS).device_page_ids == [0, 1, 3, 4]
    assert tree.match_prefix(seq(1, 2, 3), NS).device_page_ids == [0, 1, 2]


def test_namespaces_are_isolated(tree):
    other = Namespace(model_id="other", layout="x")
    tree.insert(seq(1, 2), [0, 1], NS)
    assert tree.match_prefix(seq(1, 2), other).matched_pages == 0
    tree.insert(seq(1, 2), [5, 6], other)
    assert tree.match_prefix(seq(1, 2), other).device_page_ids == [5, 6]
    assert tree.match_prefix(seq(1, 2), NS).device_page_ids == [0, 1]


def test_remainder_keys_continue_the_chain(tree):
    tree.insert(seq(1, 2), [0, 1], NS)
    match = tree.match_prefix(seq(1, 2, 3, 4, tail=1), NS, remainder_keys=True)
    expected = page_keys(seq(1, 2, 3, 4), NS, P)
    assert match.remainder_keys == expected[2:]
    assert tree.keys(match.last_node) == expected[:2]


def test_lru_evicts_least_recently_used_leaf_first(tree):
    tree.insert(seq(1, 2), [0, 1], NS)
    tree.insert(seq(3, 4), [2, 3], NS)
    tree.insert(seq(5), [4], NS)
    tree.match_prefix(seq(1, 2), NS)  # now (3, 4) is the oldest
    assert tree.evict(Tier.L1, 2) == [3, 2]
    assert tree.evict(Tier.L1, 1) == [4]
    assert tree.match_prefix(seq(3, 4), NS).matched_pages == 0  # L1-only pages leave the index


def test_evict_cuts_a_run_to_the_exact_count_from_its_tail(tree):
    tree.insert(seq(1, 2, 3, 4), [0, 1, 2, 3], NS)
    assert tree.evict(Tier.L1, 3) == [3, 2, 1]
    assert tree.match_prefix(seq(1, 2, 3, 4), NS).device_page_ids == [0]


def test_evicting_zero_is_safe_and_lock_protects_the_path(tree):
    tree.insert(seq(1, 2), [0, 1], NS)
    tree.insert(seq(1, 3), [0, 2], NS)
    assert tree.evict(Tier.L1, 0) == []
    match = tree.match_prefix(seq(1, 2), NS)
    tree.lock(match.last_node)
    assert tree.num_evictable_pages(Tier.L1) == 1
    assert tree.evict(Tier.L1, 10) == [2]  # only the branch nobody holds
    tree.unlock(match.last_node)
    assert sorted(tree.evict(Tier.L1, 10)) == [0, 1]
    with pytest.raises(RadixError, match="holds no lock"):
        tree.unlock(match.last_node)


def test_lfu_keeps_frequently_hit_runs():
    tree = RadixTree(page_size=P, eviction_policy="lfu")
    tree.insert(seq(1), [0], NS)
    tree.insert(seq(2), [1], NS)
    for _ in range(3):
        tree.match_prefix(seq(1), NS)
    tree.match_prefix(seq(2), NS)  # more recent, but hit less often
    assert tree.evict(Tier.L1, 1) == [1]
    tree.check_invariants()


def test_priority_policy_evicts_low_priority_first():
    tree = RadixTree(page_size=P, eviction_policy="priority")
    a = tree.insert(seq(1), [0], NS).last_node
    b = tree.insert(seq(2), [1], NS).last_node
    tree.set_priority(a, 5)
    tree.set_priority(b, 1)
    assert tree.evict(Tier.L1, 1) == [1]
    tree.set_priority(a, 0)
    tree.check_invariants()


def test_unknown_policy_is_rejected():
    with pytest.raises(ValueError, match="eviction policy must be one of"):
        RadixTree(eviction_policy="fifo")


def test_l2_backup_survives_l1_eviction_and_reports_as_l2(tree):
    node = tree.insert(seq(1, 2), [0, 1], NS).last_node
    tree.set_host(node, [50, 51])
    assert tree.evict(Tier.L1, 2) == [1, 0]
    match = tree.match_prefix(seq(1, 2, 3), NS)
    assert match.device_page_ids == [] and match.host_page_ids == [50, 51]
    assert match.num_l2_pages == 2 and match.l2_nodes == [node]
    # Loading back: the run adopts new device pages.
    tree.set_device(node, [7, 8])
    assert tree.match_prefix(seq(1, 2), NS).device_page_ids == [7, 8]


def test_l3_runs_follow_l2_runs_in_a_match(tree):
    node = tree.insert(seq(1, 2), [0, 1], NS).last_node
    tree.set_host(node, [50, 51])
    tree.set_l3(node)
    tree.evict(Tier.L1, 2)
    assert tree.evict(Tier.L2, 1) == [51]
    match = tree.match_prefix(seq(1, 2), NS)
    assert match.host_page_ids == [50] and match.num_l3_pages == 1
    assert tree.num_pages(Tier.L3) == 2


def test_insert_l3_indexes_pages_found_in_storage(tree):
    tree.insert(seq(1), [0], NS)
    result = tree.insert_l3(seq(1, 2, 3), NS)
    assert result.num_present_pages == 1 and result.num_new_pages == 2
    match = tree.match_prefix(seq(1, 2, 3), NS)
    assert match.device_page_ids == [0] and match.num_l3_pages == 2
    assert tree.forget_l3(5) == 2
    assert tree.match_prefix(seq(1, 2, 3), NS).matched_pages == 1


def test_insert_adopts_device_pages_for_runs_only_in_l2(tree):
    node = tree.insert(seq(1, 2), [0, 1], NS).last_node
    tree.set_host(node, [50, 51])
    tree.evict(Tier.L1, 2)
    result = tree.insert(seq(1, 2, 3), [4, 5, 6], NS)
    assert result.num_present_pages == 2 and result.duplicate_device_page_ids == []
    assert tree.match_prefix(seq(1, 2, 3), NS).device_page_ids == [4, 5, 6]


def test_residency_changes_keep_prefixes_whole(tree):
    parent = tree.insert(seq(1), [0], NS).last_node
    child = tree.insert(seq(1, 2), [0, 1], NS).last_node
    with pytest.raises(RadixError, match="faster tiers"):
        tree.clear_device(parent)  # the child is still in L1
    tree.set_host(child, [9])
    tree.clear_device(child)
    with pytest.raises(RadixError, match="faster tiers"):
        tree.clear_device(parent)  # would leave an L2 child below a run no tier holds
    with pytest.raises(RadixError, match="already in L2"):
        tree.set_host(child, [9])
    with pytest.raises(RadixError, match="L2 page ids for a run"):
        tree.set_host(parent, [1, 2])


def test_locked_runs_cannot_leave_a_tier(tree):
    node = tree.insert(seq(1), [0], NS).last_node
    tree.lock(node)
    with pytest.raises(RadixError, match="locked"):
        tree.clear_device(node)
    tree.unlock(node)
    assert tree.clear_device(node) == [0]
    with pytest.raises(RadixError, match="no longer in the tree"):
        tree.set_device(node, [0])


def test_l2_eviction_cascade_order(tree):
    # An L1 run cannot lose its backup; an L2-only leaf can.
    a = tree.insert(seq(1), [0], NS).last_node
    tree.set_host(a, [10])
    b = tree.insert(seq(2), [1], NS).last_node
    tree.set_host(b, [11])
    tree.evict(Tier.L1, 1)  # a is older: it goes to L2-only
    assert tree.evict(Tier.L2, 5) == [10]
    assert tree.num_pages(Tier.L2) == 1 and tree.num_pages(Tier.L1) == 1


def test_take_victim_and_requeue(tree):
    tree.insert(seq(1, 2), [0, 1], NS)
    victim = tree.take_victim(Tier.L1, 1)
    assert victim.device_page_ids == [1]
    tree.requeue(victim)
    tree.check_invariants()
    assert tree.evict(Tier.L1, 1) == [1]


def test_check_invariants_catches_corruption(tree):
    from radix.errors import InvariantError

    node = tree.insert(seq(1, 2), [0, 1], NS).last_node
    node.lock_ref += 1
    with pytest.raises(InvariantError, match="lock_ref"):
        tree.check_invariants()
    node.lock_ref -= 1
    tree._pages[Tier.L1] += 1
    with pytest.raises(InvariantError, match="L1 page count"):
        tree.check_invariants()
    tree._pages[Tier.L1] -= 1


def test_a_run_cannot_enter_l1_before_its_parent(tree):
    parent = tree.insert(seq(1), [0], NS).last_node
    child = tree.insert(seq(1, 2), [0, 1], NS).last_node
    tree.set_host(child, [5])
    tree.set_host(parent, [4])
    tree.clear_device(child)
    tree.clear_device(parent)
    with pytest.raises(RadixError, match="parent run is not in L1"):
        tree.set_device(child, [9])
    tree.set_device(parent, [8])
    tree.set_device(child, [9])
    assert tree.match_prefix(seq(1, 2), NS).device_page_ids == [8, 9]


def test_forget_all_l3_keeps_faster_copies(tree):
    node = tree.insert(seq(1, 2), [0, 1], NS).last_node
    tree.set_host(node, [5, 6])
    tree.set_l3(node)
    tree.insert_l3(seq(1, 2, 3, 4), NS)
    tree.insert_l3(seq(7, 8), NS)
    assert tree.forget_all_l3() == 6
    assert tree.num_pages(Tier.L3) == 0
    match = tree.match_prefix(seq(1, 2, 3, 4), NS)
    assert match.matched_pages == 2 and match.device_page_ids == [0, 1]


def test_a_second_look_does_not_count_as_a_hit(tree):
    node = tree.insert(seq(1), [0], NS).last_node
    tree.match_prefix(seq(1), NS)
    tree.match_prefix(seq(1), NS, touch=False)
    assert node.hit_count == 1


def test_a_pin_holds_one_run_and_follows_splits(tree):
    parent = tree.insert(seq(1), [0], NS).last_node
    child = tree.insert(seq(1, 2, 3), [0, 1, 2], NS).last_node
    tree.set_host(parent, [10])
    tree.pin(child)
    assert tree.evict(Tier.L1, 5) == []  # the child's L1 copy is held; the parent is above it
    head = tree.match_prefix(seq(1, 2, 7), NS).last_node  # splits the pinned run
    assert head.pins == 1 and child.pins == 1
    with pytest.raises(RadixError, match="locked"):
        tree.clear_device(child)
    tree.unpin(child)
    tree.unpin(head)
    assert sorted(tree.evict(Tier.L1, 5)) == [0, 1, 2]
    with pytest.raises(RadixError, match="not pinned"):
        tree.unpin(child)


def test_touch_moves_a_run_back_in_eviction_order(tree):
    tree.insert(seq(1), [0], NS)
    second = tree.insert(seq(2), [1], NS).last_node
    tree.match_prefix(seq(1), NS)
    tree.touch(second)
    assert tree.evict(Tier.L1, 1) == [0]
    assert second.hit_count == 0


def test_there_is_no_default_namespace():
    tree = RadixTree(P)
    with pytest.raises(TypeError):
        tree.insert(seq(1, 2), [0, 1])
    with pytest.raises(TypeError, match="Namespace"):
        tree.match_prefix(seq(1, 2), None)


# ---------------------------------------------------------------------- reading on from a node


def test_keys_after_a_node_are_the_keys_a_lookup_from_the_root_gives(tree):
    tree.insert(seq(1, 2), [0, 1], NS)
    tokens = seq(1, 2, 3, 4, tail=1)
    match = tree.match_prefix(tokens, NS, remainder_keys=True)
    assert tree.keys_after(match.last_node, tokens) == match.remainder_keys
    assert match.remainder_keys == page_keys(tokens, NS, P)[2:]
    root = tree.root(NS)
    assert tree.keys_after(root, tokens) == page_keys(tokens, NS, P)


def test_extend_l3_from_a_node_indexes_what_insert_l3_from_the_root_would():
    by_root, by_node = RadixTree(page_size=P), RadixTree(page_size=P)
    tokens = seq(1, 2, 3, 4, 5)
    for tree in (by_root, by_node):
        tree.insert(seq(1, 2), [0, 1], NS)
    by_root.insert_l3(tokens, NS, num_pages=4)
    last = by_node.match_prefix(tokens, NS, touch=False).last_node
    result = by_node.extend_l3(last, tokens, 4)
    assert result.num_present_pages == 2 and result.num_new_pages == 2
    for tree in (by_root, by_node):
        match = tree.match_prefix(tokens, NS, touch=False)
        assert (match.num_l1_pages, match.num_l3_pages, match.matched_pages) == (2, 2, 4)
        assert [n.last_access for n in RadixTree.path(match.last_node)] == [2, 2]
        tree.check_invariants()
    assert RadixTree.trailing(result.last_node, Tier.L3) == [result.last_node]
    assert RadixTree.trailing(result.last_node, Tier.L1) == []


def test_reading_on_from_a_node_off_the_tokens_path_is_refused(tree):
    node = tree.insert(seq(1, 2), [0, 1], NS).last_node
    with pytest.raises(RadixError, match="does not end a prefix"):
        tree.keys_after(node, seq(1, 7, 8))
    with pytest.raises(RadixError, match="does not end a prefix"):
        tree.extend_l3(node, seq(1), 1)
    with pytest.raises(RadixError, match="ends past"):
        tree.extend_l3(node, seq(1, 2, 3), 1)


def test_a_node_that_leaves_the_tree_still_leads_up_to_what_is_left(tree):
    tree.insert(seq(1, 2, 3), [0, 1, 2], NS)
    tokens = seq(1, 2, 3, 4, 5)
    deep = tree.insert_l3(tokens, NS).last_node  # pages 4-5, only in L3
    tree.split(deep, 1)  # a split meanwhile: `deep` stays the deeper half
    top = tree.match_prefix(seq(1, 2, 3), NS, touch=False).last_node
    tree.forget_l3(2)  # the index forgets both L3-only runs
    assert deep.level > Tier.L3 and deep not in set(tree.nodes())
    assert RadixTree.held_end(deep) is top
    assert RadixTree.held_end(top) is top
