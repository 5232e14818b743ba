"""Copies owed (docs/DESIGN.md, "Copies owed"): a copy-on-write copy made by a reservation stays
owed until a plan listing it is applied.  A discarded plan's copies (and those of a schedule()
that failed) are listed again by the next plan, before its own; the source page of an owed copy
outlives its last holder (held) until the copy is applied; a copy into pages their request lets
go is dropped.  The compiled core and the twin alike; a shadow of the backend's KV
(``step_checks.ShadowKV``) and the numpy model check that every request reads its own tokens."""

from __future__ import annotations

import numpy as np
import pytest
from helpers.step_checks import ShadowKV, assert_same_plan

import qualia
from qualia.model import DenseModel, ModelConfig, ModelWeights, PagedModelBackend, SamplingParams
from qualia.sim.adapters import PlanModelSteps
from qualia.twin import StepScheduler as TwinStepScheduler

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]     # 10 tokens: 2 full pages of 4 and a partial one
KINDS = ["core", "twin"]


def make(kind, *args, **kw):
    cls = qualia.StepScheduler if kind == "core" else TwinStepScheduler
    return cls(*args, **kw)


def facade(s):
    # the pool and its pages: the core's own, the twin's facade twin
    return s if isinstance(s, qualia.StepScheduler) else s.facade


def tables(plan):
    """Every scheduled request's pages, read from its block-table row (a row mirrors its
    request's table; entries past its pages are -1)."""
    rows = plan.block_table
    return {rid: [p for p in rows[row].tolist() if p >= 0]
            for rid, row in zip(plan.request_ids.tolist(), plan.block_table_rows.tolist())}


def step(s, shadow, ids=7):
    """One whole step: schedule, execute on the shadow, update with `ids` for every row."""
    plan = s.schedule()
    shadow.execute(plan, shadow.expect(s, plan))
    if plan.num_topk:
        m, k = len(plan.logits_indices), plan.num_topk
        tids = np.tile(np.arange(k, dtype=np.uint32) + 10, (m, 1))
        tlps = np.tile(-np.arange(k, dtype=np.float64) - 1, (m, 1))
        return plan, s.update(np.full(m, ids, np.uint32), tids, tlps)
    return plan, s.update(np.full(len(plan.logits_indices), ids, np.uint32))


def copies_of(plan):
    return [(int(c["src_page"]), int(c["dst_page"])) for c in plan.copies]


def forked_group(kind, n=3, **kw):
    """A scheduler whose n group was just forked: its next plan copies the shared partial
    page for every member but the last."""
    s = make(kind, 64, 4, 16, 8, **kw)
    shadow = ShadowKV(64, 4)
    s.add_request(1, PROMPT, max_new_tokens=6, n=n)
    plan, _ = step(s, shadow)
    assert len(plan.logits_indices) == n
    return s, shadow


def pages_in_tables(s, plan, pages):
    # how many requests' tables name each page: the plan schedules every running request
    assert s.num_running == len(plan.request_ids)
    return [sum(p in t for t in tables(plan).values()) for p in pages]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("times", [1, 2, 3])
def test_a_discarded_plans_copies_are_listed_again_until_applied(kind, times):
    s, shadow = forked_group(kind)
    first = s.schedule()
    owed = copies_of(first)
    assert len(owed) == 2                   # the partial page, for every member but the last
    for _ in range(times):
        s.discard_plan()                    # the backend failed before it copied anything
        plan = s.schedule()
        assert copies_of(plan) == owed
    shadow.execute(plan, shadow.expect(s, plan))    # the children read the prompt's K/V
    s.update(np.full(len(plan.logits_indices), 7, np.uint32))
    plan, _ = step(s, shadow)
    assert copies_of(plan) == []            # applied: owed no more
    assert s.stats()["pages_copied"] == 2    # made once, however often listed


@pytest.mark.parametrize("kind", KINDS)
def test_a_discarded_plans_copies_come_before_the_next_plans_own(kind):
    # budget 2: the plan after the fork holds request 2 and the parent only (copy 1); with
    # request 2 aborted, the next one holds the parent and the first child (copy 2)
    s = make(kind, 64, 4, 16, 8, max_num_batched_tokens=2)
    shadow = ShadowKV(64, 4)
    s.add_request(2, [8, 8, 8], max_new_tokens=30)
    s.add_request(1, PROMPT, max_new_tokens=6, n=3)
    while True:
        plan, _ = step(s, shadow)
        if 1 in plan.sampled_request_ids.tolist():
            break                           # the prompt's last row: the group forked
    plan = s.schedule()
    assert plan.request_ids.tolist() == [2, 1]
    mine = copies_of(plan)
    assert len(mine) == 1
    s.discard_plan()
    s.abort(2)
    plan = s.schedule()
    assert plan.request_ids.tolist()[:2] == [1, s.group_members(1)[1]]
    assert len(plan.copies) == 2 and copies_of(plan)[0] == mine[0]
    shadow.execute(plan, shadow.expect(s, plan))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("how", ["none", "copies", "writes", "full"])
def test_members_read_the_prompt_after_a_failed_execution(kind, how):
    s, shadow = forked_group(kind)
    plan = s.schedule()
    shadow.fail(plan, how, np.random.default_rng(1))
    s.discard_plan()
    while s.has_unfinished():
        step(s, shadow)
    assert facade(s).free_pages == facade(s).num_pages


@pytest.mark.parametrize("kind", KINDS)
def test_aborting_the_group_drops_its_owed_copies_and_returns_every_page(kind):
    s, shadow = forked_group(kind)
    src = {c[0] for c in copies_of(s.schedule())}
    s.discard_plan()
    s.abort(1)
    assert facade(s).free_pages == facade(s).num_pages
    assert all(facade(s).pool.refcount(p) == 0 for p in src)
    s.add_request(5, [9, 9, 9, 9, 9], max_new_tokens=2)
    plan, _ = step(s, shadow)
    assert copies_of(plan) == []            # nothing owed into pages nobody holds


@pytest.mark.parametrize("kind", KINDS)
def test_aborting_the_group_while_the_relisting_plan_is_pending(kind):
    s, shadow = forked_group(kind)
    s.schedule()
    s.discard_plan()
    plan = s.schedule()
    assert len(plan.copies) == 2
    s.abort(1)                              # its pages stay pinned until the plan is retired
    s.discard_plan()
    assert facade(s).free_pages == facade(s).num_pages
    s.add_request(5, [9, 9, 9, 9, 9], max_new_tokens=2)
    plan, _ = step(s, shadow)
    assert copies_of(plan) == []


def preempting_setup(kind):
    # group 1 (n=2, a 6-token prompt: page A full, page P partial) and request 2 (a 4-token
    # prompt), admitted in that order, in a pool of 4 pages: after the fork the pool has one
    # free page.  The next plan: the parent copies P (the last free page); request 2's decode
    # needs a page, so the child (the latest admitted, not yet scheduled) is preempted, and
    # with it P's last holder
    s = make(kind, 4, 4, 4, 4)
    shadow = ShadowKV(4, 4)
    s.add_request(1, [5, 6, 7, 8, 9, 10], max_new_tokens=3, n=2)
    s.add_request(2, [1, 2, 3, 4], max_new_tokens=3)
    step(s, shadow)
    assert s.num_running == 3 and facade(s).free_pages == 1
    return s, shadow


@pytest.mark.parametrize("kind", KINDS)
def test_an_owed_copys_source_outlives_its_last_holder(kind):
    s, shadow = preempting_setup(kind)
    child = s.group_members(1)[1]
    plan = s.schedule()
    [(src, dst)] = copies_of(plan)
    # the child let P go, but the copy into the parent's page still reads it: P is held (in
    # no table, referenced once) and handed to nobody, so request 2 could not be served
    assert plan.request_ids.tolist() == [1]
    assert sorted(plan.preempted_request_ids.tolist()) == sorted([child, 2])
    assert facade(s).pool.refcount(src) == 1 and pages_in_tables(s, plan, [src]) == [0]
    written = set((plan.slot_mapping // 4).tolist())
    assert src not in written
    shadow.fail(plan, "full", None)
    s.discard_plan()
    plan = s.schedule()
    assert copies_of(plan)[0] == (src, dst)
    shadow.execute(plan, shadow.expect(s, plan))
    assert not s.update(np.full(len(plan.logits_indices), 7, np.uint32))    # nobody finished
    assert [facade(s).pool.refcount(src)] == pages_in_tables(s, plan, [src])   # the hold is gone
    while s.has_unfinished():
        step(s, shadow)
    assert facade(s).free_pages == facade(s).num_pages


@pytest.mark.parametrize("kind", KINDS)
def test_preempting_the_copys_owner_drops_the_copy(kind):
    # the child copies P in a discarded plan; the next schedule preempts the child (its page
    # goes back): the copy into it is dropped, not listed again
    s = make(kind, 9, 4, 8, 8, max_num_batched_tokens=64)
    shadow = ShadowKV(9, 4)
    s.add_request(1, [5, 6, 7, 8, 9, 10], max_new_tokens=6, n=3)
    step(s, shadow)
    plan = s.schedule()
    assert len(plan.copies) == 2
    owner = {dst: rid for rid, pages in tables(plan).items() for dst in pages}
    assert all(dst in owner for _, dst in copies_of(plan))
    s.discard_plan()
    s.add_request(2, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], max_new_tokens=9,
                  priority=-1)
    while s.has_unfinished():
        plan = s.schedule()
        for _, dst in copies_of(plan):
            assert dst in tables(plan)[owner[dst]]  # a page of its running owner
        shadow.execute(plan, shadow.expect(s, plan))
        m = len(plan.logits_indices)
        s.update(np.full(m, 7, np.uint32))
    assert facade(s).free_pages == facade(s).num_pages


@pytest.mark.parametrize("kind", KINDS)
def test_beam_groups_copies_are_listed_again_after_a_discard(kind):
    s = make(kind, 64, 4, 16, 8)
    shadow = ShadowKV(64, 4)
    s.add_request(1, PROMPT, max_new_tokens=5, beam_width=3)
    rng = np.random.default_rng(0)
    seen = 0
    while s.has_unfinished():
        plan = s.schedule()
        if len(plan.copies):
            seen += 1
            owed = copies_of(plan)
            shadow.fail(plan, "copies", np.random.default_rng(seen))
            s.discard_plan()
            plan = s.schedule()
            assert copies_of(plan)[:len(owed)] == owed
        shadow.execute(plan, shadow.expect(s, plan))
        m, k = len(plan.logits_indices), plan.num_topk
        tids = np.array([rng.permutation(64)[:k] for _ in range(m)], np.uint32).reshape(m, k)
        tlps = -np.sort(rng.random((m, k)), axis=1)
        s.update(np.full(m, 7, np.uint32), tids, tlps)
    assert seen
    assert facade(s).free_pages == facade(s).num_pages


def test_core_and_twin_agree_on_owed_copies_holds_and_drops():
    """Random n groups, beam groups and plain requests in small pools (preemptions), with plans
    discarded after a partial execution and aborts in between: every plan (its copies too) and
    every page's reference count agree, and the shadow KV reads every request's tokens.  The
    workloads reach each rule: copies listed again, sources held, copies dropped."""
    from qualia.twin import step as twin_step

    seen = {"relisted": 0, "held": 0, "dropped": 0}
    hold, finish = twin_step.StepScheduler._hold, twin_step.StepScheduler._finish_pages

    def counting_hold(self, page):
        seen["held"] += 1
        hold(self, page)

    def counting_finish(self, rid):
        n = len(self._owed)
        finish(self, rid)
        seen["dropped"] += n - len(self._owed)

    mp = pytest.MonkeyPatch()
    mp.setattr(twin_step.StepScheduler, "_hold", counting_hold)
    mp.setattr(twin_step.StepScheduler, "_finish_pages", counting_finish)
    try:
        for seed in range(60):
            seen["relisted"] += _lockstep(seed)
    finally:
        mp.undo()
    assert all(seen.values()), seen


def _lockstep(seed):
    rng = np.random.default_rng(seed)
    pt = int(rng.choice([2, 4]))
    seqs = int(rng.integers(2, 6))
    nb = int(rng.integers(6, 20))
    kw = dict(max_num_batched_tokens=int(rng.integers(2, 24)), max_num_seqs=seqs,
              vocab_size=64, cache_key=b"o" * 16, max_queued=24)
    c, t = qualia.StepScheduler(nb, pt, 12, **kw), TwinStepScheduler(nb, pt, 12, **kw)
    shadow = ShadowKV(nb, pt)
    nid, relisted, owed = 0, 0, []
    for _ in range(120):
        a = rng.integers(0, 12)
        if a < 4:
            extra = (dict(beam_width=int(rng.integers(1, 3))) if a == 0 else
                     dict(n=int(rng.integers(1, seqs + 1))))
            toks = [1, 2, 3] + rng.integers(0, 64, size=int(rng.integers(1, 8))).tolist()
            mx, prio = int(rng.choice([2, 3, 5, 8])), int(rng.integers(0, 2))
            errs = []
            for s in (c, t):
                try:
                    s.add_request(nid, toks, max_new_tokens=mx, eos_token_id=3,
                                  priority=prio, **extra)
                    errs.append(None)
                except qualia.QualiaError as e:
                    errs.append(type(e))
            assert errs[0] == errs[1]
            nid += 1
            continue
        if a < 5 and nid:
            rid = int(rng.integers(0, nid))
            ok = []
            for s in (c, t):
                try:
                    s.abort(rid)
                    ok.append(True)
                except qualia.QualiaError:
                    ok.append(False)
            assert ok[0] == ok[1]
            continue
        pc, pt_ = c.schedule(), t.schedule()
        assert_same_plan(pc, pt_)
        got = copies_of(pc)
        relisted += bool(owed) and got[:len(owed)] == owed
        if rng.random() < 0.3:
            shadow.fail(pc, str(rng.choice(["none", "copies", "writes", "full"])), rng)
            c.discard_plan()
            t.discard_plan()
            owed = got
        else:
            shadow.execute(pc, shadow.expect(c, pc))
            m, k = len(pc.logits_indices), pc.num_topk
            args = [rng.integers(0, 64, size=m).astype(np.uint32)]
            if k:
                tids = np.array([rng.permutation(64)[:k] for _ in range(m)], np.uint32)
                tlps = -np.sort(rng.choice([0.0, 0.5, 1.0], size=(m, k)), axis=1)
                args += [tids.reshape(m, k), tlps]
            fc, ft = c.update(*args), t.update(*args)
            assert len(fc) == len(ft)
            owed = []
        assert ([c.pool.refcount(p) for p in range(nb)]
                == [t.facade.pool.refcount(p) for p in range(nb)])
        assert c.free_pages == t.facade.free_pages
    return relisted


# -- the numpy model: tokens equal the dense reference, plans discarded at random -----------------

W = ModelWeights.random(ModelConfig(vocab=64, layers=2))
DENSE = DenseModel(W)
HOT = SamplingParams(temperature=1.0, seed=5)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("seed", range(8))
def test_the_model_gives_the_dense_tokens_when_plans_are_discarded_at_random(kind, seed):
    """qualia.model's PagedModelBackend (its copy_pages really copies) under random discards --
    after nothing ran, after some copies, after the whole step -- gives every member of the n
    groups, every beam hypothesis and every plain request the dense reference's tokens."""
    rng = np.random.default_rng(seed)
    pt = int(rng.choice([2, 4]))
    nb = 48
    budget = int(rng.choice([3, 8, 64]))
    s = make(kind, nb, pt, 16, 6, max_num_batched_tokens=budget, vocab_size=64)
    be = PlanModelSteps(PagedModelBackend(W, nb, pt, sampling=HOT))
    prompts = {}
    for rid in range(4):
        prompts[rid] = rng.integers(0, 64, size=int(rng.integers(3, 11))).tolist()
    s.add_request(0, prompts[0], max_new_tokens=6, n=3)
    s.add_request(1, prompts[1], max_new_tokens=5, beam_width=2)
    s.add_request(2, prompts[2], max_new_tokens=4)
    s.add_request(3, prompts[3], max_new_tokens=6, n=2)
    members = {0: s.group_members(0), 3: s.group_members(3)}
    finished, discarded = {}, 0
    while s.has_unfinished():
        plan = s.schedule()
        # the first plan with copies is always discarded, then any plan at random
        if (len(plan.copies) and not discarded) or rng.random() < 0.3:
            discarded += bool(len(plan.copies))
            how = rng.integers(0, 3)
            if how == 1 and len(plan.copies):
                be.model.copy_pages(plan.copies[:int(rng.integers(0, len(plan.copies) + 1))])
            elif how == 2:
                be.execute_step(plan)           # ran whole, then the backend failed
            s.discard_plan()
            continue
        out = be.execute_step(plan)
        done = s.update(*out) if isinstance(out, tuple) else s.update(out)
        for f in done:
            finished[f.request_id] = f
    assert discarded                        # plans with copies among them
    for rid in (0, 3):
        g = finished[rid]
        want = [DENSE.generate(prompts[rid], 6 if rid == 0 else 6, sampling=HOT, request_id=m)
                for m in members[rid]]
        assert [o.tolist() for o in g.outputs] == want
    assert finished[2].output_tokens.tolist() == DENSE.generate(prompts[2], 4, sampling=HOT,
                                                                request_id=2)
    beams = [(h.tokens, h.logprob) for h in DENSE.beam_search(prompts[1], 2, 5)]
    g = finished[1]
    assert [o.tolist() for o in g.outputs] == [b[0] for b in beams]
    assert g.scores == pytest.approx([b[1] for b in beams])
    assert facade(s).free_pages == facade(s).num_pages
