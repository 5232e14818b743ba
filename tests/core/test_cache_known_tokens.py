"""The automatic prefix cache keeps only pages whose tokens it knows (docs/DESIGN.md, "Automatic
prefix caching"): a page full by its computed count but with positions whose token ids were never
given (advanced past the prompt, not decoded) is not cached, and no later prompt can hit it.  On
the compiled core and on the twin."""

from __future__ import annotations

import pytest

import qualia
from qualia.twin import cache as twin_cache

KEY = bytes(range(16))


@pytest.fixture(params=["core", "twin"])
def sched(request):
    cls = qualia.Scheduler if request.param == "core" else twin_cache.Scheduler
    return cls(4, 32, 4, 16, cache_key=KEY)


def stored(s):
    """The pages stored in the cache since the last call (their KV events)."""
    ev = s.drain_events()
    return ev["page"][ev["kind"] == twin_cache.KV_STORED].tolist()


def test_a_full_page_with_unknown_tokens_is_never_cached(sched):
    s = sched
    s.admit(1, [1, 2, 3, 4, 5])
    s.reserve(1, 8)
    s.advance(1, 8)        # page 1 is computed, but only its first token (5) is known
    assert s.token_count(1) == 8
    assert len(stored(s)) == 1
    assert s.stats()["cached_pages"] == 1
    s.complete_prefill(1, 100)
    s.finish(1)
    assert stored(s) == []
    assert s.stats()["cached_pages"] == 1
    # whatever the unknown positions held, a prompt through them hits page 0 only
    for tail in ([0, 0, 0], [5, 6, 7], [1, 2, 3]):
        assert s.cached_prefix_tokens([1, 2, 3, 4, 5] + tail + [9]) == 4


def test_a_page_is_cached_once_its_last_token_is_known(sched):
    s = sched
    s.admit(1, [1, 2, 3, 4, 5, 6, 7, 8, 9])
    s.reserve(1, 9)
    s.advance(1, 9)
    assert len(stored(s)) == 2
    assert s.stats()["cached_pages"] == 2
    s.complete_prefill(1, 100)
    s.finish(1)
    assert s.cached_prefix_tokens([1, 2, 3, 4, 5, 6, 7, 8, 0]) == 8
