"""Parallel sampling (``add_request(..., n=k)``) and beam search (``beam_width=w``) in the
compiled engine step against their pure-Python statement ``qualia.twin.StepScheduler``, call by
call (docs/DESIGN.md, "Forks at the step level", "Beam search at the step level").

``ForksVsTwin`` is the engine step's stateful machine (``helpers.step_machine.StepVsTwin``) with
``n`` groups and beam groups among the requests: every plan array (repeated logits rows, the
members' ids, the copies of the shared partial page, rows of forked children, ``num_topk``), every
result (one ``FinishedGroup`` per group, with the beams' scores), the queues, the pool's reference
counts, the parked beams, every request's tokens and every counter (``stats()`` with the pages
copied and allocated, ``cache_stats()``, ``forks``, ``fork_fallbacks``, ``parked``, the KV events,
``run()``'s rows and totals) must agree after every call, and the shadow KV (plans discarded
after a partial execution among them) must read every member's own tokens through its pages: the
partial page a fork shared is copied before a child reads it, however often the plan that copies
it is discarded.  ``ForksWithRefusedCalls`` adds ids in the child range and checks that every
refused call changes nothing.
"""

from __future__ import annotations

import numpy as np
from helpers.groups import CHILD, IDS, group_snapshot
from helpers.step_checks import (
    ShadowKV,
    assert_same_step_counters,
)
from helpers.step_machine import (
    ALLOWED,
    PREFIXES,
    PRIORITIES,
    SETTINGS,
    VOCAB,
    StepVsTwin,
    finished_key,
)
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

import qualia
from qualia.twin import StepScheduler as TwinStepScheduler


class ForksVsTwin(StepVsTwin):
    @initialize(num_blocks=st.integers(6, 24), budget=st.integers(1, 24),
                seqs=st.integers(1, 5), chunk=st.sampled_from([None, None, 1, 3, 8]),
                queued=st.sampled_from([None, 6, 12]), page_tokens=st.sampled_from([2, 4]),
                events=st.sampled_from([4096, 4096, 6, 0]))
    def setup(self, num_blocks, budget, seqs, chunk, queued, page_tokens, events):
        kw = dict(max_num_batched_tokens=budget, max_num_seqs=seqs, max_prefill_chunk=chunk,
                  max_queued=20 if queued is None else queued, vocab_size=VOCAB,
                  cache_key=b"s" * 16,
                  event_capacity=events)
        self.core = qualia.StepScheduler(num_blocks, page_tokens, 12, **kw)
        self.twin = TwinStepScheduler(num_blocks, page_tokens, 12, **kw)
        self.next_id = 0
        self.plan = None
        self.shadow = ShadowKV(num_blocks, page_tokens)

    @rule(prefix=st.sampled_from(PREFIXES),
          tail=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=9),
          n=st.integers(1, 6), max_new=st.sampled_from([1, 2, 3, 5, 8]), priority=PRIORITIES,
          eos=st.sampled_from([None, 3, 17]), stop=st.sampled_from([(), (5,), (9, 2)]),
          reuse=st.integers(0, 9))
    def group(self, prefix, tail, n, max_new, priority, eos, stop, reuse):
        rid = self.next_id if reuse else max(self.next_id - 1, 0)   # sometimes a duplicate
        self.next_id += 1
        self.both(lambda s: s.add_request(rid, prefix + tail, max_new_tokens=max_new, n=n,
                                          priority=priority, eos_token_id=eos,
                                          stop_token_ids=stop))

    @rule(prefix=st.sampled_from(PREFIXES),
          tail=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=9),
          width=st.integers(1, 6) | st.sampled_from([0, True, 2.0]),
          n=st.sampled_from([1, 1, 1, 1, 2]), max_new=st.sampled_from([1, 2, 3, 5, 8]),
          priority=PRIORITIES, eos=st.sampled_from([None, 3, 17]),
          stop=st.sampled_from([(), (5,), (9, 2)]), reuse=st.integers(0, 9))
    def beam(self, prefix, tail, width, n, max_new, priority, eos, stop, reuse):
        rid = self.next_id if reuse else max(self.next_id - 1, 0)   # sometimes a duplicate
        self.next_id += 1
        self.both(lambda s: s.add_request(rid, prefix + tail, max_new_tokens=max_new, n=n,
                                          beam_width=width, priority=priority,
                                          eos_token_id=eos, stop_token_ids=stop))

    @rule(k=st.integers(0, 3), tail=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=9),
          max_new=st.sampled_from([1, 2, 5]))
    def at_child_base(self, k, tail, max_new):
        # a user id where the children's ids start: children skip it while it is taken, also
        # while it is aborted in a pending plan (its pages are still under its id)
        self.both(lambda s: s.add_request(CHILD + k, tail, max_new_tokens=max_new))

    @rule(k=st.integers(0, 3))
    def abort_at_child_base(self, k):
        # such an id aborted while a plan is pending: its pages stay with it until the plan is
        # retired, and the next plan reports it finished; children skip it meanwhile
        self.both(lambda s: s.abort(CHILD + k))

    def update_call(self, ids, rng, bad):
        # a plan with beam rows takes [m, num_topk] candidates: distinct ids per row,
        # log-probabilities on a coarse grid (ties between beams and ids happen), sometimes
        # missing or malformed (a repeated id, NaN)
        k = self.plan.num_topk
        if not k:
            return super().update_call(ids, rng, bad)
        m = len(self.plan.logits_indices)
        tids = np.array([rng.permutation(VOCAB)[:k] for _ in range(m)]).reshape(m, k)
        tlps = -0.25 * np.sort(rng.integers(0, 8, size=(m, k)), axis=1)   # best first
        how = rng.integers(0, 16) if bad != "steps" else 99
        if how == 0:
            return lambda s: s.update(ids)
        if how == 1:
            tids = tids[:, :-1]
        elif how == 2:
            tids = tids.astype(np.float64)
        elif how == 3 and m:
            tids[-1, -1] = VOCAB
        elif how == 4:
            tids, tlps = tids.tolist(), tlps.tolist()
        elif how == 5 and m and k > 1:
            tids[-1, 1] = tids[-1, 0]       # refused when the row is a beam's of width > 1
        elif how == 6 and m:
            tlps[0, -1] = np.nan
        elif how == 7 and m and k > 1:
            tlps[-1, 0] = tlps[-1, 1] - 0.5  # not best first: refused on a live beam's row
        return lambda s: s.update(ids, tids, tlps)

    @precondition(lambda self: self.plan is None)
    @rule(seed=st.integers(0, 2**32 - 1), how=st.sampled_from(["none", "copies", "writes", "full"]),
          times=st.integers(1, 3), pick=st.sampled_from([None, None, 0, 1, 2]))
    def discard_copies(self, seed, how, times, pick):
        # whole steps until a plan copies pages (a fork's shared partial page); that plan is
        # discarded after a failed execution, and so are the next `times - 1`; a request of the
        # discarded plan (a group by its id) is sometimes aborted before the next plan
        rng = np.random.default_rng(seed)
        for _ in range(24):
            self.schedule()
            if self.plan is None:
                return
            if len(self.plan.copies):
                break
            ids = rng.integers(0, VOCAB, size=len(self.plan.logits_indices)).astype(np.uint32)
            call = self.update_call(ids, rng, "steps")
            self.execute()
            out = self.both(lambda s: finished_key(call(s)))
            assert out[0][1] == out[1][1]
            self.plan = None
        else:
            return
        for k in range(times):
            rids = self.plan.request_ids.tolist()
            self.discard(how, int(rng.integers(0, 2**32)))
            if pick is not None and k == 0 and pick < len(rids):
                self.both(lambda s: s.abort(rids[pick]))
            if k + 1 < times:
                self.schedule()
                if self.plan is None:
                    return

    @rule(pick=st.integers(0, 40), child=st.integers(0, 3))
    def abort_member(self, pick, child):
        # a child's id (refused: abort the group) or the group by its parent's id
        rid = pick % (self.next_id + 2)
        out = self.both(lambda s: s.group_members(rid))
        if out[0][0] == "ok":
            assert out[0][1] == out[1][1]
            member = out[0][1][child % len(out[0][1])]
            self.both(lambda s: s.abort(member))

    @invariant()
    def agree(self):
        if not hasattr(self, "core"):
            return
        c, t = self.core, self.twin
        assert c.num_waiting == t.num_waiting
        assert c.num_running == t.num_running
        assert c.has_unfinished() == t.has_unfinished()
        assert c.free_pages == t.facade.free_pages
        assert [c.pool.refcount(p) for p in range(c.num_pages)] == \
            [t.facade.pool.refcount(p) for p in range(c.num_pages)]
        # members share their parent's arrival: the twin lists them in the order they became
        # requests, the core by (arrival, id)
        assert sorted(c.requests()) == sorted(t.requests())
        for rid in c.requests():
            assert c.request_tokens(rid).tolist() == t.request_tokens(rid).tolist()
            assert c.request_pages(rid).tolist() == t.request_pages(rid).tolist()
        assert_same_step_counters(c, t)


TestForksVsTwin = ForksVsTwin.TestCase
TestForksVsTwin.settings = SETTINGS


PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]


class ForksWithRefusedCalls(ForksVsTwin):
    """``ForksVsTwin`` and what it does not reach: user ids in the range of the internal child ids
    (from 2**63 up) and at 2**64-1, a group aborted in its pending plan and its id added again at
    once, and every refused call checked to change nothing (``group_snapshot``: the queues, every
    request's tokens, every group's members, every page's refcount and the fork counters)."""

    def both(self, fn):
        before = [group_snapshot(s) for s in (self.core, self.twin)]
        out = []
        for s, snap in zip((self.core, self.twin), before):
            try:
                out.append(("ok", fn(s)))
            except ALLOWED as exc:
                out.append(("err", type(exc)))
                assert group_snapshot(s) == snap, (type(s).__name__, exc)
        assert out[0][0] == out[1][0], out
        if out[0][0] == "err":
            assert out[0][1] is out[1][1], out
        return out

    @rule(pick=st.sampled_from(IDS), n=st.integers(1, 4), max_new=st.sampled_from([1, 2, 5]),
          tail=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6))
    def add_in_child_range(self, pick, n, max_new, tail):
        # user ids where the children's ids live, and at the top of the u64 range
        self.both(lambda s: s.add_request(pick, [7, 7] + tail, max_new_tokens=max_new, n=n))

    @rule(pick=st.sampled_from(IDS))
    def abort_any(self, pick):
        self.both(lambda s: s.abort(pick))

    @precondition(lambda self: self.plan is not None)
    @rule(n=st.integers(1, 4))
    def abort_planned_group_and_add_it_again(self, n):
        # the first group of the pending plan (by its parent id) aborted, its id added again
        # before update(): the old plan's rows must be ignored, the new group left alone
        for rid in self.plan.request_ids.tolist():
            out = self.both(lambda s: s.group_members(rid))
            if out[0][0] == "ok" and out[0][1][0] == rid:
                self.both(lambda s: s.abort(rid))
                self.both(lambda s: s.add_request(rid, PROMPT, max_new_tokens=3, n=n))
                return

    @rule()
    def groups_agree(self):
        for rid in IDS + list(range(self.next_id + 1)):
            a = self.both(lambda s: s.group_members(rid))
            assert a[0] == a[1]


TestForksWithRefusedCalls = ForksWithRefusedCalls.TestCase


TestForksWithRefusedCalls.settings = SETTINGS
