"""Beam search breaks ties between equal scores one way (docs/DESIGN.md, "Beam search at the step
level"): candidates by higher cumulative score, then the earlier beam (member order), then the
lower token id.  Exact ties, chosen so that each rule decides which hypotheses are kept and in what
order, on the compiled core and on the twin."""

from __future__ import annotations

import numpy as np
import pytest

import qualia
from qualia import FinishedGroup
from qualia.twin import StepScheduler as TwinStepScheduler

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


@pytest.fixture(params=["core", "twin"])
def make(request):
    cls = qualia.StepScheduler if request.param == "core" else TwinStepScheduler
    return lambda: cls(64, 4, 16, 8, vocab_size=64)


def step(s, cands):
    """One step: each beam row takes the candidates cands[request id] (ids, log-probabilities,
    best first); its sampled id is its first candidate."""
    plan = s.schedule()
    k = plan.num_topk
    rows = plan.sampled_request_ids.tolist()
    tids = np.array([cands[r][0] for r in rows], dtype=np.int64).reshape(len(rows), k)
    tlps = np.array([cands[r][1] for r in rows], dtype=np.float64).reshape(len(rows), k)
    return s.update(tids[:, 0].copy(), tids, tlps)


def test_equal_candidates_of_one_beam_go_lower_token_id_first(make):
    s = make()
    s.add_request(1, PROMPT, max_new_tokens=3, beam_width=2)
    assert step(s, {1: ([7, 5], [-1.0, -1.0])}) == []
    # the first continuation keeps the beam itself: it takes the lower id, the fork the other
    beam, child = s.group_members(1)
    assert beam == 1
    assert s.request_tokens(1).tolist() == PROMPT + [5]
    assert s.request_tokens(child).tolist() == PROMPT + [7]


def test_equal_scores_of_two_beams_go_to_the_earlier_beam_then_the_lower_token_id(make):
    s = make()
    s.add_request(1, PROMPT, max_new_tokens=2, beam_width=2)
    step(s, {1: ([7, 5], [-1.0, -1.0])})
    beam, child = s.group_members(1)
    # four candidates of score -3; two are kept: the earlier beam's (it holds token 5), lower
    # id first
    done = step(s, {beam: ([9, 8], [-2.0, -2.0]), child: ([11, 10], [-2.0, -2.0])})
    assert len(done) == 1 and isinstance(done[0], FinishedGroup)
    g = done[0]
    assert g.request_id == 1
    assert [o.tolist() for o in g.outputs] == [[5, 8], [5, 9]]
    assert g.scores == [-3.0, -3.0]
    assert g.finish_reasons == ["length", "length"]
    assert not s.has_unfinished()
