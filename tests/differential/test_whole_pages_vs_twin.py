"""Pages of 16 and 32 tokens in the compiled engine step against the twin.

The stateful machines and most step tests use pages of a few tokens.  At 16 tokens a page, the
size most engines run, the core takes paths of its own: the page hash's unrolled loop, the
page's tokens copied into its cache record in one fixed-size copy, and a whole page's positions
and slots lowered in vector stores (docs/DESIGN.md, "In the compiled core").  This test runs
prompts of many pages, sharing prefixes so that pages are cached, hit and reclaimed, prefilled
in chunks of any length and decoded, and checks every plan, result,
token list, page identity and counter against the twin, and every step's K/V reads (ShadowKV).
Pages of 32 tokens take the general paths at the same lengths.
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers.step_checks import (
    ShadowKV,
    assert_same_plan,
    assert_same_step_counters,
    finished_key,
)

import qualia
from qualia.twin import StepScheduler as TwinStepScheduler

VOCAB = 50
KEY = b"w" * 16


def _prompt(rng, prefixes, page_tokens):
    # a shared prefix of whole pages and a partial one, then a few pages of its own
    head = prefixes[int(rng.integers(0, len(prefixes)))][:int(rng.integers(0, 3 * page_tokens))]
    own = rng.integers(0, VOCAB, size=int(rng.integers(1, 4 * page_tokens))).tolist()
    return head + own


@pytest.mark.parametrize("page_tokens", [16, 32])
def test_whole_pages_agree_with_the_twin(page_tokens):
    rng = np.random.default_rng(page_tokens)
    num_pages = 120
    kw = {"max_num_batched_tokens": 5 * page_tokens + 3, "max_num_seqs": 12,
          "max_queued": 64, "vocab_size": VOCAB, "cache_key": KEY,
          "max_prefill_chunk": 2 * page_tokens + 5}
    core = qualia.StepScheduler(num_pages, page_tokens, 10, **kw)
    twin = TwinStepScheduler(num_pages, page_tokens, 10, **kw)
    shadow = ShadowKV(num_pages, page_tokens)
    scheds = (core, twin)
    prefixes = [rng.integers(0, VOCAB, size=3 * page_tokens).tolist() for _ in range(3)]
    next_id = whole_pages = 0
    for step in range(2000):
        while len(core.requests()) < 40 and step < 240:
            prompt = _prompt(rng, prefixes, page_tokens)
            new = int(rng.integers(1, 40))
            for s in scheds:
                s.add_request(next_id, prompt, max_new_tokens=new)
            next_id += 1
        a, b = core.schedule(), twin.schedule()
        assert_same_plan(a, b)
        qsl = a.query_start_loc
        for j, rid in enumerate(a.request_ids.tolist()):
            lo, hi = int(qsl[j]), int(qsl[j + 1])
            pos = a.positions[lo:hi]
            whole_pages += int(np.count_nonzero(pos % page_tokens == 0)
                               * (hi - lo >= page_tokens))
            assert core.request_tokens(rid)[pos].tolist() == a.input_ids[lo:hi].tolist()
        shadow.execute(a, ShadowKV.expect(core, a))
        ids = rng.integers(0, VOCAB, size=len(a.logits_indices)).astype(np.uint32)
        done = [finished_key(s.update(ids)) for s in scheds]
        assert done[0] == done[1], step
        for rid in core.requests():
            assert core.request_tokens(rid).tolist() == twin.request_tokens(rid).tolist()
        assert_same_step_counters(core, twin)
        if step % 10 == 0:
            prompt = _prompt(rng, prefixes, page_tokens)
            # (the twin step's pages and cache are its facade's)
            assert (core.page_identities(prompt).tolist()
                    == twin.facade.page_identities(prompt).tolist())
            assert (core.cached_prefix_tokens(prompt)
                    == twin.facade.cached_prefix_tokens(prompt))
        if not core.requests() and step >= 240:
            break
    assert not core.requests() and not twin.requests()
    # the run lowered many whole pages in chunks (what the test is for)
    assert whole_pages >= 100, whole_pages
    stats = core.cache_stats()
    assert stats == twin.cache_stats()
    assert stats.hit_tokens > 0 and stats.reclaims > 0, stats
