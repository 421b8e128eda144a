"""Exceptions of the radix index: misuse of its API, and a broken invariant."""


class RadixError(Exception):
    """An operation the index cannot do as asked (the message says why)."""


class InvariantError(RadixError):
    """`RadixTree.check_invariants` found state that contradicts itself."""
