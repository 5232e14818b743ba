"""Parallel sampling (``add_request(..., n=k)``) and beam search (``beam_width=w``) in the
compiled engine step, against their pure-Python statement ``qualia.twin.StepScheduler``
(docs/DESIGN.md, "Forks at the step level", "Beam search at the step level").

``ForksVsTwin`` is the engine step's stateful differential test (tests/test_step_stateful.py)
with ``n`` groups and beam groups among the requests: every plan array (repeated logits rows,
the members' ids, the copies of the shared partial page, rows of forked children, ``num_topk``),
every result (one ``FinishedGroup`` per group, with the beams' scores), the queues, the pool's
reference counts, the parked beams, every request's tokens and every counter (``stats()`` with
the pages copied and allocated, ``cache_stats()``, ``forks``, ``fork_fallbacks``, ``parked``, the
KV events, ``run()``'s rows and totals) must agree after every call, and the shadow KV (plans
discarded after a partial execution among them) must read every member's own tokens through its
pages: the partial page a fork shared is copied before a child reads it, however often the plan
that copies it is discarded.  The dense checks run ``qualia.model``'s seeded per-member sampler
and its beam search through the core and compare each result with its dense run.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule
from step_checks import ShadowKV, assert_same_plan, assert_same_step_counters
from test_step_abi import example_rule, example_topk_rule
from test_step_stateful import PREFIXES, PRIORITIES, SETTINGS, VOCAB, StepVsTwin, finished_key

import qualia
from qualia.errors import StepError
from qualia.model import DenseModel, ModelConfig, ModelWeights, PagedModelBackend, SamplingParams
from qualia.sim.adapters import PlanModelSteps
from qualia.twin import StepScheduler as TwinStepScheduler
from qualia.twin.groups import CHILD_BASE


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
        assert_same_step_counters(c, t)


TestForksVsTwin = ForksVsTwin.TestCase
TestForksVsTwin.settings = SETTINGS


W = ModelWeights.random(ModelConfig(vocab=64, layers=1))
DENSE = DenseModel(W)
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
HOT = SamplingParams(temperature=1.0, seed=11)


class CoreModelBackend:
    """execute_step for qualia.StepScheduler over the paged numpy model (the simulator's
    adapter)."""

    def __init__(self, num_blocks, page_tokens):
        self.b = PlanModelSteps(PagedModelBackend(W, num_blocks, page_tokens, sampling=HOT))

    def execute_step(self, plan):
        return np.asarray(self.b.execute_step(plan), dtype=np.uint32)


@pytest.mark.parametrize("page_tokens,prompt_len", [(4, 10), (4, 8), (1, 5), (3, 10)])
@pytest.mark.parametrize("budget,seqs", [(2048, 8), (3, 8), (64, 4)])
def test_every_member_equals_its_dense_run_and_the_twin(page_tokens, prompt_len, budget, seqs):
    """Each member's tokens equal DenseModel.generate with the member's id; the core's run
    equals the twin's step for step (stats and results)."""
    prompt = PROMPT[:prompt_len]
    kw = dict(max_num_batched_tokens=budget, max_num_seqs=seqs, max_queued=32)
    c = qualia.StepScheduler(64, page_tokens, 32, **kw)
    t = TwinStepScheduler(64, page_tokens, 32, **kw)
    for s in (c, t):
        s.add_request(1, prompt, max_new_tokens=6, n=4)
        s.add_request(2, prompt[:3], max_new_tokens=4)
    members = c.group_members(1)
    assert members == t.group_members(1) and members[0] == 1 and len(set(members)) == 4
    rc = c.run(CoreModelBackend(64, page_tokens))
    rt = t.run(CoreModelBackend(64, page_tokens))
    assert np.array_equal(rc.stats, rt.stats)
    assert finished_key(rc.finished) == finished_key(rt.finished)
    g = [f for f in rc.finished if isinstance(f, qualia.FinishedGroup)][0]
    assert g.request_id == 1 and g.member_ids == members and g.scores is None
    outs = [o.tolist() for o in g.outputs]
    assert outs == [DENSE.generate(prompt, 6, sampling=HOT, request_id=m) for m in members]
    assert len({tuple(o) for o in outs}) > 1
    assert c.forks + c.fork_fallbacks == 3
    assert c.free_pages == c.num_pages


def test_the_prompt_row_is_sampled_once_per_member_and_the_partial_page_copied():
    c = qualia.StepScheduler(64, 4, 16, 8)
    c.add_request(1, PROMPT, max_new_tokens=3, n=3)
    plan = c.schedule()
    assert plan.logits_indices.tolist() == [len(PROMPT) - 1] * 3
    assert plan.sampled_request_ids.tolist() == c.group_members(1)
    assert c.update([1, 2, 3]) == []
    assert c.num_running == 3 and c.forks == 2
    plan = c.schedule()
    assert len(plan.copies) == 2            # the shared partial page, once per child but the last
    assert plan.block_table_rows.tolist() == [0, 1, 2]
    assert plan.kv_indices.tolist()[:2] == plan.kv_indices.tolist()[3:5]   # full pages shared


@pytest.mark.parametrize("kind", ["core", "twin"])
def test_step_page_counters_count_the_shared_page_copies_as_copies(kind):
    cls = qualia.StepScheduler if kind == "core" else TwinStepScheduler
    s = cls(64, 4, 16, 8)
    s.add_request(1, PROMPT, max_new_tokens=6, n=3)          # 10 tokens: pages 0, 1, 2

    def step(tokens):
        s.schedule()
        s.update(np.array(tokens, np.uint32))

    def pages():
        return s.stats()["pages_allocated"], s.stats()["pages_copied"]

    step([1, 2, 3])                         # the prompt, then the forks
    assert pages() == (3, 0)
    step([4, 5, 6])                         # each child but the last copies the partial page
    assert pages() == (3, 2)
    step([7, 8, 9])                         # position 11: in place
    step([7, 8, 9])                         # position 12: one fresh page per member
    assert pages() == (6, 2)
    assert s.stats()["used_pages"] == 2 + 3 * 2 and s.stats()["num_pages"] == 64


def test_queue_capacity_counts_every_member():
    c = qualia.StepScheduler(64, 4, 16, 4, max_queued=5)
    t = TwinStepScheduler(64, 4, 16, 4, max_queued=5)
    for s in (c, t):
        s.add_request(1, PROMPT, max_new_tokens=3, n=4)
        with pytest.raises(StepError.QueueFull):
            s.add_request(2, PROMPT, max_new_tokens=3, n=2)
        s.add_request(3, PROMPT, max_new_tokens=3)
        with pytest.raises(StepError.QueueFull):
            s.add_request(4, PROMPT, max_new_tokens=3)


@pytest.mark.parametrize("kw,exc", [(dict(n=0), ValueError), (dict(n=9), ValueError),
                                    (dict(n=True), TypeError), (dict(n=2.0), TypeError)])
def test_bad_n_changes_nothing(kw, exc):
    c = qualia.StepScheduler(64, 4, 16, 8)
    with pytest.raises(exc):
        c.add_request(1, PROMPT, max_new_tokens=3, **kw)
    assert not c.has_unfinished()


def test_member_ids_are_taken_and_aborting_the_group_releases_everything():
    c = qualia.StepScheduler(64, 4, 16, 8)
    c.add_request(1, PROMPT, max_new_tokens=5, n=3)
    members = c.group_members(1)
    with pytest.raises(StepError.DuplicateRequest):
        c.add_request(members[1], PROMPT, max_new_tokens=3)
    c.update([1, 2, 3]) if c.schedule() is not None else None
    with pytest.raises(StepError.UnknownRequest):
        c.abort(members[2])                 # a member alone
    c.abort(1)
    assert not c.has_unfinished() and c.free_pages == c.num_pages
    plan = c.schedule()
    assert sorted(plan.finished_request_ids.tolist()) == sorted(members)
    c.update([])
    with pytest.raises(StepError.UnknownRequest):
        c.group_members(1)


def test_groups_in_the_c_run_loop_equal_a_python_loop_and_the_twin():
    """run() with a C step backend (the GIL-free loop) plans and finishes groups as the Python
    loop does, and as the twin does with the same (hash) sampler."""
    hb = qualia.HashBackend()
    kw = dict(max_num_batched_tokens=16, max_num_seqs=4, max_prefill_chunk=6, max_queued=32)
    a, b = qualia.StepScheduler(14, 4, 16, **kw), qualia.StepScheduler(14, 4, 16, **kw)
    t = TwinStepScheduler(14, 4, 16, **kw)
    for s in (a, b, t):
        s.add_request(1, PROMPT, max_new_tokens=5, n=3)
        s.add_request(2, PROMPT[:4], max_new_tokens=6, n=4)
        s.add_request(3, PROMPT[2:], max_new_tokens=4)
    result = a.run(hb)

    class Py:
        def execute_step(self, plan):
            return hb.execute_step(plan)
    rb, rt = b.run(Py()), t.run(Py())
    assert np.array_equal(result.stats, rb.stats) and np.array_equal(result.stats, rt.stats)
    assert finished_key(result.finished) == finished_key(rb.finished) == \
        finished_key(rt.finished)
    assert sorted(type(f).__name__ for f in result.finished) == \
        ["FinishedGroup", "FinishedGroup", "FinishedRequest"]
    assert a.free_pages == a.num_pages


@pytest.mark.parametrize("seqs", [8, 4])
def test_groups_without_prefix_caching_equal_their_dense_runs(seqs):
    """prefix_caching='off' (the twin models 'auto' only): the members still fork and share the
    prompt's pages, and a child queued for lack of a row recomputes its prompt."""
    c = qualia.StepScheduler(64, 4, 32, seqs, prefix_caching="off", max_queued=32)
    c.add_request(1, PROMPT, max_new_tokens=6, n=4)
    c.add_request(2, PROMPT[:3], max_new_tokens=4)
    members = c.group_members(1)
    r = c.run(CoreModelBackend(64, 4))
    g = [f for f in r.finished if isinstance(f, qualia.FinishedGroup)][0]
    assert [o.tolist() for o in g.outputs] == \
        [DENSE.generate(PROMPT, 6, sampling=HOT, request_id=m) for m in members]
    assert c.forks + c.fork_fallbacks == 3 and (c.fork_fallbacks > 0) == (seqs == 4)
    assert c.free_pages == c.num_pages


# -- beam groups ---------------------------------------------------------------------------------

class CoreBeamBackend:
    """execute_step for qualia.StepScheduler over the paged numpy model, with candidates for beam
    rows (``(ids, topk_ids, topk_logprobs)`` when ``plan.num_topk > 0``)."""

    def __init__(self, num_blocks, page_tokens, sampling=HOT):
        self.b = PlanModelSteps(PagedModelBackend(W, num_blocks, page_tokens, sampling=sampling))

    def execute_step(self, plan):
        return self.b.execute_step(plan)


def dense_beams(prompt, width, new, **kw):
    return [(h.tokens, h.logprob) for h in DENSE.beam_search(prompt, width, new, **kw)]


def beams_of(g):
    return [(o.tolist(), sc) for o, sc in zip(g.outputs, g.scores)]


def drive(s, backend):
    """schedule -> execute -> update by hand; returns the finished records and the plans'
    num_topk."""
    finished, topk = [], []
    while s.has_unfinished():
        plan = s.schedule()
        topk.append(plan.num_topk)
        out = backend.execute_step(plan)
        finished += s.update(*out) if isinstance(out, tuple) else s.update(out)
    return finished, topk


@pytest.mark.parametrize("width", [1, 2, 3, 4])
@pytest.mark.parametrize("eos", [None, 17])
@pytest.mark.parametrize("budget,seqs", [(2048, 8), (5, 4)])
def test_beam_search_equals_the_dense_beam_search_and_the_twin(width, eos, budget, seqs):
    """The core's beam group, driven by hand beside an n group and a plain request, returns the
    dense beam search's hypotheses and scores, best first; the twin gives the same plans and
    results."""
    kw = dict(max_num_batched_tokens=budget, max_num_seqs=seqs, max_queued=32)
    c = qualia.StepScheduler(64, 4, 16, **kw)
    t = TwinStepScheduler(64, 4, 16, **kw)
    for s in (c, t):
        s.add_request(1, PROMPT, max_new_tokens=6, beam_width=width, eos_token_id=eos)
        s.add_request(2, PROMPT[:4], max_new_tokens=5, n=2)
        s.add_request(3, PROMPT[2:], max_new_tokens=3)
    fc, kc = drive(c, CoreBeamBackend(64, 4))
    ft, kt = drive(t, CoreBeamBackend(64, 4))
    assert kc == kt and max(kc) == width
    assert finished_key(fc) == finished_key(ft)
    g = [f for f in fc if f.request_id == 1][0]
    assert isinstance(g, qualia.FinishedGroup) and g.member_ids == []
    assert beams_of(g) == dense_beams(PROMPT, width, 6, eos_token_id=eos)
    assert g.scores == sorted(g.scores, reverse=True)
    assert c.forks == t.forks and c.parked == t.parked
    assert c.free_pages == c.num_pages


def test_beam_search_with_stop_ids_and_run_with_a_python_backend():
    """run() takes (ids, topk_ids, topk_logprobs) from a Python backend; stop ids finish
    hypotheses early, as in the dense search."""
    first = [tk for tk, _ in dense_beams(PROMPT, 4, 1)]
    stop = [first[0][0], first[2][0]]
    c = qualia.StepScheduler(64, 4, 16, 8)
    c.add_request(1, PROMPT, max_new_tokens=6, beam_width=4, stop_token_ids=stop)
    r = c.run(CoreBeamBackend(64, 4))
    g = r.finished[0]
    assert beams_of(g) == dense_beams(PROMPT, 4, 6, stop_token_ids=stop)
    assert "stop" in g.finish_reasons
    assert c.free_pages == c.num_pages


def test_beams_under_preemption_park_and_match_the_twin():
    """Two beam groups and an n group on a small pool: preemption, parking (a computed beam
    waits for a queued sibling) and fork fallbacks; plans, results and counters agree with the
    twin step for step, and each group equals its dense search."""
    kw = dict(max_num_batched_tokens=6, max_num_seqs=3, max_queued=24)
    c = qualia.StepScheduler(12, 2, 12, **kw)
    t = TwinStepScheduler(12, 2, 12, **kw)
    for s in (c, t):
        s.add_request(1, PROMPT[:7], max_new_tokens=5, beam_width=3)
        s.add_request(2, PROMPT[:4], max_new_tokens=5, n=2, priority=1)
        s.add_request(3, PROMPT[3:], max_new_tokens=4, beam_width=2)
    bc, bt = CoreBeamBackend(12, 2), CoreBeamBackend(12, 2)
    fc, ft = [], []
    while c.has_unfinished() or t.has_unfinished():
        pc, pt = c.schedule(), t.schedule()
        assert_same_plan(pc, pt)
        oc, ot = bc.execute_step(pc), bt.execute_step(pt)
        fc += c.update(*oc) if isinstance(oc, tuple) else c.update(oc)
        ft += t.update(*ot) if isinstance(ot, tuple) else t.update(ot)
        assert [c.pool.refcount(p) for p in range(12)] == \
            [t.facade.pool.refcount(p) for p in range(12)]
    assert finished_key(fc) == finished_key(ft)
    assert (c.forks, c.fork_fallbacks, c.parked) == (t.forks, t.fork_fallbacks, t.parked)
    assert c.parked > 0 and c.fork_fallbacks > 0       # the case this test is about
    got = {f.request_id: f for f in fc}
    assert beams_of(got[1]) == dense_beams(PROMPT[:7], 3, 5)
    assert beams_of(got[3]) == dense_beams(PROMPT[3:], 2, 4)


def test_a_beam_group_holds_its_width_of_queue_entries():
    c = qualia.StepScheduler(64, 4, 16, 4, max_queued=5)
    t = TwinStepScheduler(64, 4, 16, 4, max_queued=5)
    for s in (c, t):
        s.add_request(1, PROMPT, max_new_tokens=3, beam_width=3)
        with pytest.raises(StepError.QueueFull):
            s.add_request(2, PROMPT, max_new_tokens=3, beam_width=3)
        s.add_request(3, PROMPT, max_new_tokens=3, n=2)
        with pytest.raises(StepError.QueueFull):
            s.add_request(4, PROMPT, max_new_tokens=3)
        s.abort(1)
        s.add_request(5, PROMPT, max_new_tokens=3, beam_width=3)


@pytest.mark.parametrize("kw,exc", [(dict(beam_width=0), ValueError),
                                    (dict(beam_width=9), ValueError),
                                    (dict(beam_width=True), TypeError),
                                    (dict(beam_width=2.0), TypeError),
                                    (dict(beam_width="2"), TypeError),
                                    (dict(beam_width=2, n=2), ValueError)])
def test_bad_beam_width_changes_nothing(kw, exc):
    c = qualia.StepScheduler(64, 4, 16, 8)
    t = TwinStepScheduler(64, 4, 16, 8)
    for s in (c, t):
        with pytest.raises(exc):
            s.add_request(1, PROMPT, max_new_tokens=3, **kw)
        assert not s.has_unfinished()
        s.add_request(1, PROMPT, max_new_tokens=3)


def test_beams_that_cannot_fit_side_by_side_never_fit():
    # 4 beams of a 10-token prompt and 6 new tokens on 4-token pages: 2 shared + 4 x 2 pages
    for s in (qualia.StepScheduler(9, 4, 16, 8), TwinStepScheduler(9, 4, 16, 8)):
        with pytest.raises(StepError.NeverFits):
            s.add_request(1, PROMPT, max_new_tokens=6, beam_width=4)
        s.add_request(1, PROMPT, max_new_tokens=6, beam_width=3)


@pytest.mark.parametrize("bad", ["missing", "one", "narrow", "float_ids", "vocab", "negative",
                                 "strings", "rows", "unsorted"])
def test_bad_candidates_change_nothing(bad):
    """A beam plan's update without valid [m, num_topk] candidates raises and leaves the plan
    pending with nothing applied; the same update with good candidates then matches the
    twin."""
    c = qualia.StepScheduler(64, 4, 16, 8, vocab_size=64)
    t = TwinStepScheduler(64, 4, 16, 8, vocab_size=64)
    b = CoreBeamBackend(64, 4)
    for s in (c, t):
        s.add_request(1, PROMPT, max_new_tokens=3, beam_width=2)
    pc = c.schedule()
    assert_same_plan(pc, t.schedule())
    ids, tids, tlps = b.execute_step(pc)
    args = {"missing": (ids,), "one": (ids, tids), "narrow": (ids, tids[:, :1], tlps[:, :1]),
            "float_ids": (ids, tids.astype(np.float64), tlps),
            "vocab": (ids, np.full_like(tids, 64), tlps),
            "negative": (ids, -tids - 1, tlps), "strings": (ids, tids, [["a", "b"]]),
            "rows": (ids, np.vstack([tids, tids]), np.vstack([tlps, tlps])),
            "unsorted": (ids, tids[:, ::-1], tlps[:, ::-1])}[bad]   # not best first
    for s in (c, t):
        with pytest.raises((ValueError, TypeError)):
            s.update(*args)
    assert c.request_tokens(1).tolist() == PROMPT and c.forks == 0
    assert finished_key(c.update(ids, tids, tlps)) == finished_key(t.update(ids, tids, tlps))
    assert c.forks == t.forks == 1
    assert c.group_members(1) == t.group_members(1)


def test_a_plan_without_beam_rows_ignores_candidates():
    c = qualia.StepScheduler(64, 4, 16, 8)
    c.add_request(1, PROMPT, max_new_tokens=3)
    plan = c.schedule()
    assert plan.num_topk == 0
    assert c.update([5], object(), "not an array") == []


def test_beams_in_the_c_run_loop_equal_a_python_loop_and_the_twin():
    """run(HashBackend()) runs beam groups without the GIL (the backend writes candidates);
    the same HashBackend through a Python loop, and the twin, plan and finish the same."""
    hb = qualia.HashBackend(vocab=64)
    kw = dict(max_num_batched_tokens=16, max_num_seqs=4, max_prefill_chunk=6, max_queued=32)
    a, b = qualia.StepScheduler(40, 4, 16, **kw), qualia.StepScheduler(40, 4, 16, **kw)
    t = TwinStepScheduler(40, 4, 16, **kw)
    for s in (a, b, t):
        s.add_request(1, PROMPT, max_new_tokens=5, beam_width=3)
        s.add_request(2, PROMPT[:4], max_new_tokens=6, n=2)
        s.add_request(3, PROMPT[2:], max_new_tokens=4, beam_width=2, eos_token_id=7)
    result = a.run(hb)

    class Py:
        def execute_step(self, plan):
            return hb.execute_step_topk(plan) if plan.num_topk else hb.execute_step(plan)
    rb, rt = b.run(Py()), t.run(Py())
    assert np.array_equal(result.stats, rb.stats) and np.array_equal(result.stats, rt.stats)
    assert finished_key(result.finished) == finished_key(rb.finished) == \
        finished_key(rt.finished)
    assert sorted(f.request_id for f in result.finished if f.scores is not None) == [1, 3]
    assert a.forks == t.forks > 0 and a.free_pages == a.num_pages


def test_hash_backend_candidates_follow_its_rule():
    hb = qualia.HashBackend(vocab=50)
    c = qualia.StepScheduler(64, 4, 16, 8)
    c.add_request(1, PROMPT, max_new_tokens=3, beam_width=4)
    plan = c.schedule()
    ids, tids, tlps = hb.execute_step_topk(plan)
    assert np.array_equal(ids, hb.execute_step(plan))
    assert tids.shape == tlps.shape == (1, 4) and tids.dtype == np.uint32
    assert tids[0].tolist() == [(int(ids[0]) + j) % 50 for j in range(4)]
    t = int(plan.logits_indices[0])
    assert tlps[0, 0] == qualia.hash_logprob(1, int(plan.positions[t]), int(plan.input_ids[t]))
    assert all(np.diff(tlps[0]) < 0)


@pytest.mark.parametrize("kind", ["c", "cython"])
def test_run_refuses_a_beam_plan_for_a_c_backend_without_candidates(example_backend,
                                                                    cython_backend, kind):
    """A C step backend that does not declare QUALIA_STEP_WRITES_TOPK (the examples built with
    topk=False) gets no beam plan: while a beam group is queued or running, run() refuses it
    before any step and changes nothing."""
    c = qualia.StepScheduler(64, 4, 16, 8)
    c.add_request(2, PROMPT[:3], max_new_tokens=2)
    c.add_request(1, PROMPT, max_new_tokens=3, beam_width=2)
    before = (c.num_waiting, c.num_running, c.free_pages, c.request_tokens(1).tolist())
    without = (example_backend.new_step(64, topk=False) if kind == "c"
               else cython_backend.StepBackend(64, topk=False))
    with pytest.raises(TypeError, match="QUALIA_STEP_WRITES_TOPK"):
        c.run(without)
    assert (c.num_waiting, c.num_running, c.free_pages, c.request_tokens(1).tolist()) == before
    assert before[:2] == (2, 0)
    r = c.run(qualia.HashBackend(vocab=64))
    assert len(r.finished) == 2 and c.free_pages == c.num_pages


class PyExampleBeams:
    """The step examples' rule (examples/c_backend: sampled tokens and beam candidates), as a
    Python step backend."""

    def __init__(self, vocab):
        self.vocab = vocab

    def execute_step(self, plan):
        if plan.num_topk:
            return example_topk_rule(plan, self.vocab, plan.num_topk)
        return example_rule(plan, self.vocab)


@pytest.mark.parametrize("kind", ["c", "cython"])
@pytest.mark.parametrize("budget,seqs,blocks,page_tokens,preempts", [
    (2048, 8, 64, 4, False), (7, 3, 24, 4, False), (16, 6, 12, 2, True)])
def test_example_step_backends_run_beam_groups(example_backend, cython_backend, kind, budget,
                                               seqs, blocks, page_tokens, preempts):
    """run(example step backend) writes candidates without the GIL: every beam group finishes
    with `width` hypotheses, best first, and the run (preemptions included, on a small pool)
    equals driving schedule/update by hand with the same rule in Python, and the twin fed that
    rule."""
    kw = dict(max_num_batched_tokens=budget, max_num_seqs=seqs, max_prefill_chunk=6,
              max_queued=32)
    a, b, t = (cls(blocks, page_tokens, 16, **kw)
               for cls in (qualia.StepScheduler, qualia.StepScheduler, TwinStepScheduler))
    widths = {1: 3, 3: 2, 4: 1}
    for s in (a, b, t):
        s.add_request(1, PROMPT, max_new_tokens=5, beam_width=3)
        s.add_request(2, PROMPT[:4], max_new_tokens=6, n=2)
        s.add_request(3, PROMPT[2:], max_new_tokens=4, beam_width=2, eos_token_id=7)
        s.add_request(4, PROMPT[1:6], max_new_tokens=3, beam_width=1)
        s.add_request(5, PROMPT[3:], max_new_tokens=4)
    backend = (example_backend.new_step(64) if kind == "c" else cython_backend.StepBackend(64))
    result = a.run(backend)
    py = PyExampleBeams(64)
    by_hand, topk = drive(b, py)
    rt = t.run(py)
    assert finished_key(result.finished) == finished_key(by_hand) == finished_key(rt.finished)
    assert np.array_equal(result.stats, rt.stats) and max(topk) == 3
    assert (int(result.stats["num_preempted"].sum()) > 0) == preempts
    groups = {f.request_id: f for f in result.finished
              if isinstance(f, qualia.FinishedGroup) and f.scores is not None}
    assert sorted(groups) == sorted(widths)
    for rid, g in groups.items():
        assert len(g.outputs) == len(g.scores) == widths[rid]
        assert g.scores == sorted(g.scores, reverse=True)
    assert a.forks == t.forks and a.free_pages == a.num_pages


@pytest.mark.parametrize("kind", ["core", "twin"])
def test_plans_name_forks_and_a_discarded_plans_admissions(kind):
    """A plan names the forks made since the previous plan (child, parent), and a discarded
    plan's forks and new ids are named again by the next plan; a forked child is not new."""
    kw = dict(max_num_batched_tokens=64)
    s = (qualia.StepScheduler(64, 4, 16, 8, **kw) if kind == "core"
         else TwinStepScheduler(64, 4, 16, 8, **kw))
    s.add_request(7, PROMPT, max_new_tokens=4, n=3)
    plan = s.schedule()
    assert plan.new_request_ids.tolist() == [7] and plan.fork_child_ids.tolist() == []
    s.discard_plan()
    plan = s.schedule()
    assert plan.new_request_ids.tolist() == [7]          # the discarded plan's, named again
    s.update(np.arange(len(plan.sampled_request_ids), dtype=np.uint32) + 11)
    children = [m for m in s.group_members(7) if m != 7]
    assert len(children) == 2
    plan = s.schedule()
    assert plan.new_request_ids.tolist() == []
    assert plan.fork_child_ids.tolist() == children
    assert plan.fork_parent_ids.tolist() == [7, 7]
    assert plan.fork_child_ids.dtype == plan.fork_parent_ids.dtype == np.uint64
    s.discard_plan()
    plan = s.schedule()
    assert plan.fork_child_ids.tolist() == children      # named again after the discard
    s.update(np.full(len(plan.sampled_request_ids), 12, dtype=np.uint32))
    plan = s.schedule()
    assert plan.new_request_ids.tolist() == [] and plan.fork_child_ids.tolist() == []


def test_the_c_abi_plan_carries_the_forks():
    """run() hands the forks to a C step backend in the plan struct (num_forks, fork_child_ids,
    fork_parent_ids), as the Python plan names them."""
    import ctypes

    from ctypes_abi import EXECUTE_STEP
    from test_step_harden import c_backend

    seen = []

    def execute(ctx, plan, sampled_out, logprobs_out):
        p = plan.contents
        kids = ctypes.cast(p.fork_child_ids, ctypes.POINTER(ctypes.c_uint64))
        pars = ctypes.cast(p.fork_parent_ids, ctypes.POINTER(ctypes.c_uint64))
        seen.append([(kids[i], pars[i]) for i in range(p.num_forks)])
        out = ctypes.cast(sampled_out, ctypes.POINTER(ctypes.c_uint32))
        for r in range(p.num_sampled):
            out[r] = 20 + r
        return 0

    cb = EXECUTE_STEP(execute)
    s = qualia.StepScheduler(64, 4, 16, 8, max_num_batched_tokens=64)
    s.add_request(7, PROMPT, max_new_tokens=2, n=3)
    s.run(c_backend(cb))
    kids = sorted(c for step in seen for c, _ in step)
    assert seen[0] == [] and len(seen[1]) == 2 and all(p == 7 for _, p in seen[1])
    assert len(kids) == 2 and all(k >= CHILD_BASE for k in kids)
    assert all(step == [] for step in seen[2:])
