"""Parallel sampling (n > 1) and beam search over copy-on-write forks at the step level, in the
twin (qualia.twin.StepScheduler, DESIGN.md "Forks at the step level"): every member's tokens equal
the dense run with the same sampler and request id, beam search equals the dense beam search of
the same width, the prompt's pages are held once, and misuse is refused changing nothing."""

from __future__ import annotations

import pytest
from helpers.step_checks import run_steps

from qualia import FinishedGroup
from qualia.errors import StepError
from qualia.model import DenseModel, ModelConfig, ModelWeights, PagedModelBackend, SamplingParams
from qualia.sim.adapters import PlanModelSteps
from qualia.twin import StepScheduler as TwinStepScheduler
from qualia.twin.groups import CHILD_BASE

W = ModelWeights.random(ModelConfig(vocab=64, layers=1))
DENSE = DenseModel(W)
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
HOT = SamplingParams(temperature=1.0, seed=11)


def world(num_pages=64, page_tokens=4, logical_pages=16, max_num_seqs=8, sampling=HOT, **kw):
    s = TwinStepScheduler(num_pages, page_tokens, logical_pages, max_num_seqs, **kw)
    return s, PlanModelSteps(PagedModelBackend(W, num_pages, page_tokens, sampling=sampling))


def groups(finished):
    return {f.request_id: f for f in finished if isinstance(f, FinishedGroup)}


def dense(prompt, new, member, sampling=HOT, **kw):
    return DENSE.generate(prompt, new, sampling=sampling, request_id=member, **kw)


def dense_beams(prompt, width, new, **kw):
    return [(h.tokens, h.logprob) for h in DENSE.beam_search(prompt, width, new, **kw)]


def beams_of(g):
    return [(o.tolist(), sc) for o, sc in zip(g.outputs, g.scores)]


@pytest.mark.parametrize("page_tokens,prompt_len", [(4, 10), (4, 8), (1, 5), (3, 10)])
@pytest.mark.parametrize("budget", [2048, 3])
def test_every_child_equals_its_dense_run(page_tokens, prompt_len, budget):
    s, b = world(page_tokens=page_tokens, logical_pages=32, max_num_batched_tokens=budget)
    prompt = PROMPT[:prompt_len]
    s.add_request(1, prompt, max_new_tokens=6, n=4)
    s.add_request(2, prompt[:3], max_new_tokens=4)
    members = s.group_members(1)
    assert members[0] == 1 and len(set(members)) == 4
    finished, _, _ = run_steps(s, b)
    g = groups(finished)[1]
    assert g.finish_reasons == ["length"] * 4 and g.member_ids == members
    outs = [o.tolist() for o in g.outputs]
    assert outs == [dense(prompt, 6, m) for m in members]
    assert len({tuple(o) for o in outs}) > 1          # the members really sample apart
    plain = [f for f in finished if not isinstance(f, FinishedGroup)][0]
    assert plain.output_tokens.tolist() == dense(prompt[:3], 4, 2)
    assert s.forks == 3 and s.fork_fallbacks == 0
    assert s.facade.free_pages == s.facade.num_pages


def test_the_prompt_row_is_sampled_once_per_member():
    s, b = world()
    s.add_request(1, PROMPT, max_new_tokens=3, n=3)
    plan = s.schedule()
    assert plan.logits_indices.tolist() == [len(PROMPT) - 1] * 3
    assert plan.sampled_request_ids.tolist() == s.group_members(1)
    s.update(b.execute_step(plan))
    assert s.num_running == 3 and s.forks == 2
    plan = s.schedule()
    assert len(plan.copies) == 2                    # the shared partial page, once per child


def test_prompt_pages_are_held_once_and_the_partial_page_copied_per_child():
    pt, n, new = 4, 8, 8
    s, b = world(num_pages=64, page_tokens=pt, logical_pages=8)
    s.add_request(1, PROMPT, max_new_tokens=new, n=n)       # 10 tokens: 2 full + 2
    _, peak, _ = run_steps(s, b)
    assert s.stats()["pages_copied"] == n - 1
    tail = -(-(len(PROMPT) + new - 1) // pt) - len(PROMPT) // pt    # own pages per member
    assert peak == len(PROMPT) // pt + n * tail
    # n independent requests of the same prompt (no forks; full pages shared by the cache)
    s2, b2 = world(num_pages=64, page_tokens=pt, logical_pages=8)
    for r in range(n):
        s2.add_request(10 + r, PROMPT, max_new_tokens=new)
    _, peak2, _ = run_steps(s2, b2)
    assert peak2 >= peak


def test_eos_and_stop_tokens_stop_members_independently():
    s, b = world()
    s.add_request(1, PROMPT, max_new_tokens=12, n=6, eos_token_id=7, stop_token_ids=[9, 40])
    members = s.group_members(1)
    g = groups(run_steps(s, b)[0])[1]
    for j, out in enumerate(g.outputs):
        ref = dense(PROMPT, 12, members[j], eos_token_id=7, stop_token_ids=(9, 40))
        assert out.tolist() == ref
        assert g.finish_reasons[j] == ("stop" if ref[-1] in (7, 9, 40) else "length")


def test_children_without_a_free_slot_wait_and_still_match():
    s, b = world(max_num_seqs=2)
    s.add_request(1, PROMPT, max_new_tokens=5, n=2)
    s.add_request(2, PROMPT, max_new_tokens=5, n=2)
    ids = {1: s.group_members(1), 2: s.group_members(2)}
    g = groups(run_steps(s, b)[0])
    for rid in (1, 2):
        assert [o.tolist() for o in g[rid].outputs] == [dense(PROMPT, 5, m) for m in ids[rid]]
    assert s.fork_fallbacks >= 1
    assert s.facade.free_pages == s.facade.num_pages


def test_preemption_keeps_every_member_exact():
    s, b = world(num_pages=9, page_tokens=2, logical_pages=12)
    s.add_request(1, PROMPT[:6], max_new_tokens=6, n=3)
    s.add_request(2, PROMPT[:5], max_new_tokens=5, n=2, priority=1)
    ids = {1: s.group_members(1), 2: s.group_members(2)}
    preempted = 0
    finished = []
    while s.has_unfinished():
        plan = s.schedule()
        preempted += len(plan.preempted_request_ids)
        finished += s.update(b.execute_step(plan))
    assert preempted > 0
    g = groups(finished)
    assert [o.tolist() for o in g[1].outputs] == [dense(PROMPT[:6], 6, m) for m in ids[1]]
    assert [o.tolist() for o in g[2].outputs] == [dense(PROMPT[:5], 5, m) for m in ids[2]]


@pytest.mark.parametrize("width", [1, 2, 3, 4])
@pytest.mark.parametrize("eos", [None, 0, 5, 17, 39])
def test_beam_search_equals_the_dense_beam_search(width, eos):
    s, b = world()
    s.add_request(1, PROMPT, max_new_tokens=6, beam_width=width, eos_token_id=eos)
    g = groups(run_steps(s, b)[0])[1]
    assert beams_of(g) == dense_beams(PROMPT, width, 6, eos_token_id=eos)
    assert g.scores == sorted(g.scores, reverse=True)
    assert s.facade.free_pages == s.facade.num_pages


def test_beam_search_with_stop_ids_finishes_hypotheses_early():
    # the dense reference's most likely first tokens become stop ids
    first = [t for t, _ in dense_beams(PROMPT, 4, 1)]
    stop = [first[0][0], first[2][0]]
    s, b = world()
    s.add_request(1, PROMPT, max_new_tokens=6, beam_width=4, stop_token_ids=stop)
    g = groups(run_steps(s, b)[0])[1]
    assert beams_of(g) == dense_beams(PROMPT, 4, 6, stop_token_ids=stop)
    assert "stop" in g.finish_reasons


def test_beam_search_under_preemption_and_beside_other_requests():
    s, b = world(num_pages=12, page_tokens=2, logical_pages=12, max_num_seqs=6, max_queued=24)
    s.add_request(1, PROMPT[:7], max_new_tokens=5, beam_width=3)
    s.add_request(2, PROMPT[:4], max_new_tokens=5, n=2, priority=1)
    ids = s.group_members(2)
    preempted = 0
    finished = []
    while s.has_unfinished():
        plan = s.schedule()
        preempted += len(plan.preempted_request_ids)
        finished += s.update(*b.execute_step(plan)) if plan.num_topk else \
            s.update(b.execute_step(plan))
    assert preempted > 0
    g = groups(finished)
    assert beams_of(g[1]) == dense_beams(PROMPT[:7], 3, 5)
    assert [o.tolist() for o in g[2].outputs] == [dense(PROMPT[:4], 5, m) for m in ids]


@pytest.mark.parametrize("kw,exc", [
    (dict(n=0), ValueError), (dict(n=9), ValueError), (dict(n=True), TypeError),
    (dict(n=2.0), TypeError), (dict(beam_width=0), ValueError),
    (dict(beam_width=2, n=2), ValueError), (dict(beam_width="2"), TypeError),
])
def test_bad_group_arguments_change_nothing(kw, exc):
    s, _ = world()
    with pytest.raises(exc):
        s.add_request(1, PROMPT, max_new_tokens=3, **kw)
    assert not s.has_unfinished() and s.requests() == []
    s.add_request(1, PROMPT, max_new_tokens=3)     # the id was not taken


def test_member_ids_are_reserved_and_aborting_the_group_releases_everything():
    s, b = world()
    s.add_request(1, PROMPT, max_new_tokens=8, n=3)
    child = s.group_members(1)[1]
    assert child == CHILD_BASE
    with pytest.raises(StepError.DuplicateRequest):
        s.add_request(child, PROMPT, max_new_tokens=3)
    for _ in range(3):
        plan = s.schedule()
        s.update(b.execute_step(plan))
    assert s.forks == 2
    with pytest.raises(StepError.UnknownRequest):
        s.abort(child)                      # a member: abort the group instead
    s.abort(1)
    assert not s.has_unfinished()
    s.facade.clear_cache()
    assert s.facade.free_pages == s.facade.num_pages


def test_a_beam_plan_needs_its_candidates():
    s, b = world()
    s.add_request(1, PROMPT, max_new_tokens=3, beam_width=2)
    plan = s.schedule()
    assert plan.num_topk == 2
    ids, tids, tlps = b.execute_step(plan)
    with pytest.raises(ValueError):
        s.update(ids)
    with pytest.raises(ValueError):
        s.update(ids, tids[:, :1], tlps[:, :1])
    s.update(ids, tids, tlps)               # the plan was still pending: nothing changed
    assert s.forks == 1


def test_run_drives_groups_and_beams():
    s, b = world()
    s.add_request(1, PROMPT, max_new_tokens=4, n=3)
    s.add_request(2, PROMPT[:6], max_new_tokens=4, beam_width=2)
    ids = s.group_members(1)
    result = s.run(b)
    g = groups(result.finished)
    assert [o.tolist() for o in g[1].outputs] == [dense(PROMPT, 4, m) for m in ids]
    assert beams_of(g[2]) == dense_beams(PROMPT[:6], 2, 4)
    assert len(result.stats) > 0 and not s.has_unfinished()


# -- random workloads ---------------------------------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

REQUEST = st.tuples(
    st.sampled_from(["plain", "n", "beam"]), st.integers(1, 4),         # kind, n / width
    st.integers(1, 9), st.integers(1, 6),                                # prompt length, new
    st.sampled_from([None, 5, 17]), st.integers(0, 2),                   # eos, priority
    st.integers(0, 3),                                                   # prompt variant
)


@settings(max_examples=200, deadline=None)
@given(requests=st.lists(REQUEST, min_size=1, max_size=4),
       max_requests=st.integers(2, 6), num_blocks=st.integers(8, 40),
       page_tokens=st.sampled_from([1, 2, 3, 4]), budget=st.sampled_from([2, 5, 64]),
       abort_at=st.one_of(st.none(), st.integers(0, 12)))
def test_random_groups_match_the_dense_references(requests, max_requests, num_blocks,
                                                  page_tokens, budget, abort_at):
    """Any mix of plain requests, n groups and beam groups, under any pool, budget and slot
    count (preemption, fork fallbacks), each result equals its dense reference; an aborted
    request returns nothing; every page comes back."""
    s, b = world(num_pages=num_blocks, page_tokens=page_tokens, logical_pages=24,
                 max_num_seqs=max_requests, max_num_batched_tokens=budget)
    expect = {}
    for rid, (kind, k, plen, new, eos, prio, var) in enumerate(requests, start=1):
        prompt = [(t + var * 7) % 64 for t in PROMPT[:plen]]
        k = min(k, max_requests)
        kw = dict(max_new_tokens=new, eos_token_id=eos, priority=prio)
        try:
            if kind == "n":
                s.add_request(rid, prompt, n=k, **kw)
            elif kind == "beam":
                s.add_request(rid, prompt, beam_width=k, **kw)
            else:
                s.add_request(rid, prompt, **kw)
        except StepError.NeverFits:
            continue
        if kind == "n" and k == 1:
            kind = "plain"                    # n=1 is an ordinary request
        members = s.group_members(rid) if kind == "n" else [rid]
        expect[rid] = (kind, k, prompt, new, eos, members)
    finished = []
    steps = 0
    aborted = None
    while s.has_unfinished():
        if steps == abort_at and expect:
            aborted = sorted(expect)[0]
            if aborted in s.requests():
                s.abort(aborted)
            else:
                aborted = None
        plan = s.schedule()
        out = b.execute_step(plan)
        finished += s.update(*out) if isinstance(out, tuple) else s.update(out)
        steps += 1
        assert steps < 300
    got = {f.request_id: f for f in finished}
    for rid, (kind, k, prompt, new, eos, members) in expect.items():
        if rid == aborted:
            assert rid not in got
            continue
        f = got[rid]
        if kind == "beam":
            assert beams_of(f) == dense_beams(prompt, k, new, eos_token_id=eos)
        elif kind == "n":
            assert [o.tolist() for o in f.outputs] == [
                dense(prompt, new, m, eos_token_id=eos) for m in members]
        else:
            assert f.output_tokens.tolist() == dense(prompt, new, rid, eos_token_id=eos)
    s.facade.clear_cache()
    assert s.facade.free_pages == s.facade.num_pages
