"""Checks shared by the robustness tests: edge cases, ownership and seeded stress (a helper
module)."""

from __future__ import annotations

from collections import Counter


def invariants(s):
    """The facade's page accounting is exact: every reference is held by a table or the store.
    Returns the active request ids."""
    held: Counter = Counter()
    rids = s.runnable()["request_id"].tolist()
    for rid in rids:
        table = s.block_table(rid).tolist()
        assert len(table) <= s.logical_pages
        held.update(table)
    for ident in s.prefixes.identities():
        held.update(s.prefixes.pages_of(ident))
    refcounts = s.pool.refcounts().tolist()
    assert refcounts == [held[p] for p in range(s.num_pages)]
    assert s.free_pages + sum(1 for c in refcounts if c) == s.num_pages
    return rids
