"""The group kinds of the engine-step twin (docs/DESIGN.md, "Forks at the step level", "Beam
search at the step level"): ``n`` groups (parallel sampling) and beam groups, over
copy-on-write forks.  ``qualia.twin.step.StepScheduler`` holds a group by its id (the parent's
request id) and by each member id; its one ``update`` hands a sampled row of an ``n`` group's
parent not yet forked to :func:`fork_n`, a beam's row of candidates to the group, and lets each
beam group that took candidates :func:`select`.  Read beside core/step/groups.pxi and
core/step/beams.pxi.

* ``n`` group (``add_request(..., n=k)``): the prompt is prefilled once.  The step whose chunk
  reaches the end of the prompt samples ``k`` rows from the prompt's last logits row
  (``logits_indices`` repeats that row, ``sampled_request_ids`` names the members); ``update``
  then forks the parent into ``k - 1`` children, each continuing with its own first token.  The
  children share every page of the prompt, the partly filled last page included: the first
  decode of each copies that page (``plan.copies``).  Members decode and stop independently;
  when the last one stops, ``update`` returns one ``FinishedGroup`` with the ``k`` outputs under
  the parent's id, in member order.
* beam group (``add_request(..., beam_width=w)``): beam search as a policy over fork and finish,
  the policy of the dense reference ``qualia.model.DenseModel.beam_search``: ``w`` places hold
  live or finished beams.  Each live beam's row asks the backend for its ``plan.num_topk = w``
  best next tokens with their log-probabilities.  When every live beam of the group is computed
  and has its candidates, the candidates (scored by cumulative log-probability; ties: the
  earlier beam, then the lower id) fill the ``w - finished`` free places in order; a kept
  candidate that is a stop token (eos unless ignored, or a stop id) or reaches
  ``max_new_tokens`` finishes a hypothesis.  A beam with no live continuation is finished
  (pages released), a beam with ``c`` live continuations forks ``c - 1`` children and continues
  with the first.  The group ends when no beam is live; the result is the hypotheses best first
  (ties: finished first first).

Sampling is the backend's: ``qualia.sim.adapters.PlanModelSteps`` over
``qualia.model.PagedModelBackend`` runs the model's keyed sampler, which draws row ``i`` keyed
by ``(seed, sampled_request_ids[i], position)``; the members of a group have distinct ids
(``FinishedGroup.member_ids``), so the dense reference ``DenseModel.generate(..., sampling=...,
request_id=member)`` draws the same tokens whatever the batching, preemption or recomputation.

When no request slot or plan row is free for a child at fork time, the child waits as an
ordinary request holding its prompt and first token (it is admitted later, sharing the prompt's
full pages through the prefix cache): slower, never wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional, Tuple

import numpy as np

from qualia._types import FinishedGroup, RequestState
from qualia.twin.seed import exact_int, token_limit

if TYPE_CHECKING:  # pragma: no cover - types only
    from qualia.twin.step import StepScheduler, _Req

__all__ = ["NGroup", "BeamGroup", "CHILD_BASE", "group_size"]

#: internal ids of children start here and count up, skipping ids in use
CHILD_BASE = 1 << 63


@dataclass
class NGroup:
    """An ``n`` group: ``members`` are the parent's id, then the children's (reserved at
    ``add_request``); ``results`` the outputs of the members that stopped."""

    parent: int
    width: int
    members: List[int]
    forked: bool = False
    results: Dict[int, Tuple[List[int], str]] = field(default_factory=dict)


@dataclass
class BeamGroup:
    """A beam group: ``members`` are the live beams' ids, in member order; ``hyps`` the
    finished hypotheses (score, order finished, tokens, reason); ``cum`` each live beam's
    cumulative log-probability; ``cand`` the candidates (ids, log-probabilities) of the live
    beams computed since the last selection."""

    parent: int
    width: int
    members: List[int]
    hyps: List[Tuple[float, int, List[int], str]] = field(default_factory=list)
    cum: Dict[int, float] = field(default_factory=dict)
    cand: Dict[int, Tuple[List[int], List[float]]] = field(default_factory=dict)


def group_size(value, name: str, max_num_seqs: int) -> int:
    """``n`` or ``beam_width``: an integer (``__index__``, numpy integers too; not a bool)
    in [1, max_num_seqs], as an exact int (an int subclass's own comparisons never run)."""
    v = exact_int(value, name)
    if not 1 <= v <= max_num_seqs:
        raise ValueError(f"{name} must be in [1, max_num_seqs={max_num_seqs}], got {v}")
    return v


# -- forks (core/step/groups.pxi) ------------------------------------------------------------------

def spawn(s: "StepScheduler", parent: "_Req", cid: int) -> "_Req":
    """A child of the running ``parent`` (its tokens so far): forked when a slot and a row are
    free, else queued as an ordinary request (admitted later through the cache)."""
    f = s.facade
    child = parent.child(cid)
    s._reserved.discard(cid)
    s._reqs[cid] = child
    if parent.running and s._rows_free and f.active_count < f.max_requests:
        if f._slots[f._find(parent.request_id)].state != RequestState.DECODE:
            f.complete_prefill(parent.request_id, 0)   # fork needs a decoding parent
        f.fork(parent.request_id, cid)
        child.running = True
        child.num_computed = parent.num_computed
        child.admitted = next(s._admissions)
        child.row = s._rows_free.pop(0)
        s._running.append(child)
        s._forked_since.append((cid, parent.request_id))
        s.forks += 1
    else:
        s._enqueue(child)
        s.fork_fallbacks += 1
    return child


def fork_n(s: "StepScheduler", g: NGroup, parent: "_Req", toks: List[int],
           finished: List[Any]) -> None:
    """The parent of ``g`` sampled one token per member: fork the children, then each member
    takes its own token (the children first, the parent last)."""
    g.forked = True
    children = [spawn(s, parent, cid) for cid in g.members[1:]]
    for j, child in enumerate(children, start=1):
        s._group_of[child.request_id] = g
        s._take(child, toks[j], finished)
    s._take(parent, toks[0], finished)


# -- beams (core/step/beams.pxi) -------------------------------------------------------------------

def park(s: "StepScheduler", r: "_Req") -> None:
    """A computed beam leaves the running list with its candidates: pages back (full pages stay
    cached), no row; out of the queues until its group selects."""
    s._stop_running(r)
    s._parked[r.request_id] = r
    s.parked += 1


def park_blocked(s: "StepScheduler") -> None:
    """After a step that scheduled nothing: every running beam (each is computed and waits for
    a sibling) is parked, groups in add order and beams in member order.

    A beam group selects once every live beam has its candidates.  A computed beam whose
    sibling waits would hold its slot, row and pages for nothing -- with several groups,
    forever.  Parked, it keeps its candidates and leaves the running list (full pages stay
    cached), so the next step admits the head of the queue.  A parked beam is not queued: it
    needs nothing until its group selects (docs/DESIGN.md, "Progress")."""
    for g in list(s._groups.values()):
        if not isinstance(g, BeamGroup):
            continue
        for m in g.members:
            r = s._reqs[m]
            if r.running and r.num_computed == len(r.tokens):
                park(s, r)


def select(s: "StepScheduler", g: BeamGroup, finished: List[Any]) -> None:
    """When every live beam of ``g`` has its candidates: keep the best ``w - hypotheses``; each
    finishes a hypothesis or continues a beam (a beam's first continuation takes the beam, each
    further one forks a child).  No live continuation: the group's result goes to
    ``finished``."""
    live = [s._reqs[b] for b in g.members]
    if not all(b.request_id in g.cand for b in live):
        return          # a beam is still being computed: select when all have candidates
    cands: List[Tuple[float, int, int, "_Req"]] = []
    for rank, b in enumerate(live):
        base = g.cum.get(b.request_id, 0.0)
        ids, lps = g.cand[b.request_id]
        cands.extend((base + lp, rank, int(tok), b) for tok, lp in zip(ids, lps))
    cands.sort(key=lambda c: (-c[0], c[1], c[2]))
    g.cand.clear()
    kept: List[Tuple["_Req", int, float]] = []
    for score, _, tok, b in cands[:g.width - len(g.hyps)]:
        out = b.tokens[b.prompt_len:] + [tok]
        reason = b.finish_reason(tok, len(out), stop_first=True)
        if reason is not None:
            g.hyps.append((score, len(g.hyps), out, reason))
        else:
            kept.append((b, tok, score))
    if not kept:
        for b in live:
            s._finish_member(b)
        hyps = sorted(g.hyps, key=lambda h: (-h[0], h[1]))
        s._finishing.add(g.parent)
        finished.append(FinishedGroup(
            g.parent, [np.array(h[2], dtype=np.uint32) for h in hyps],
            [h[3] for h in hyps], [h[0] for h in hyps], []))
        s._drop_group(g)
        return
    # beams with no live continuation go first (their slots and rows free up for the forks)
    users = {b.request_id for b, _, _ in kept}
    for b in live:
        if b.request_id not in users:
            s._finish_member(b)
            del s._group_of[b.request_id]
            g.cum.pop(b.request_id, None)
    # then each kept beam forks its extra continuations before noting its own token
    seen = set()
    order: List[Tuple["_Req", int, float]] = []
    for b, tok, score in kept:
        if b.request_id in seen:
            child = spawn(s, b, s._new_child_id())
            s._group_of[child.request_id] = g
            order.append((child, tok, score))
        else:
            seen.add(b.request_id)
            order.append((b, tok, score))
    g.members = []
    for r, tok, score in order:
        s._note(r, tok)
        g.cum[r.request_id] = score
        g.members.append(r.request_id)


def chunk_rows(plan) -> Iterator[Tuple[Any, int, int, int]]:
    """The plan's chunks in order, each as ``(request, tokens, first, end)``: its sampled rows
    are ``first .. end - 1`` (the rows whose logits index is the chunk's last token)."""
    qsl = plan.query_start_loc.tolist()
    li = plan.logits_indices.tolist()
    m = len(li)
    row = 0
    for i, (req, n) in enumerate(plan._chunks):
        first = row
        while row < m and li[row] == qsl[i + 1] - 1:
            row += 1
        yield req, n, first, row


def resolve_topk(topk_ids, topk_logprobs) -> Tuple[Any, Any, Optional[Exception]]:
    """update()'s candidates as private arrays, before any state is read (user code --
    ``__array__``, sequences -- runs here only); a conversion error is raised later, and only
    when the plan has beam rows (a plan without them ignores the arguments)."""
    if topk_ids is None or topk_logprobs is None:
        return None, None, None
    try:
        return np.array(topk_ids), np.array(topk_logprobs), None
    except Exception as exc:
        return None, None, exc


def check_topk(s: "StepScheduler", plan, topk_ids, topk_logprobs,
               err: Optional[Exception]) -> Tuple[np.ndarray, np.ndarray]:
    """The pending plan's candidates, checked before anything is applied: ``[m, num_topk]``
    integer ids in the vocabulary and log-probabilities (each a number at most 0), a live beam
    row's first ``w`` ids distinct and its log-probabilities best first.  A plan without beam
    rows takes none (empty arrays)."""
    m, k = len(plan.logits_indices), plan.num_topk
    if not k:
        return np.zeros((0, 0)), np.zeros((0, 0))
    if err is not None:
        raise err
    if topk_ids is None or topk_logprobs is None:
        raise ValueError(f"this plan has beam rows: pass topk_ids and topk_logprobs "
                         f"of shape ({m}, {k})")
    tids = np.asarray(topk_ids)
    tlps = np.asarray(topk_logprobs)
    if (tids.shape != (m, k) or tlps.shape != (m, k) or tids.dtype.kind not in "iu"
            or tlps.dtype.kind not in "fiu"):
        raise ValueError(f"topk_ids / topk_logprobs must be ({m}, {k}) integer / float "
                         f"arrays")
    limit = token_limit(s.vocab_size)
    if tids.size and (int(tids.min()) < 0 or int(tids.max()) > limit):
        raise ValueError(f"a topk token id is outside [0, {limit}]")
    tlps = tlps.astype(np.float64)
    # a log-probability is at most 0 (NaN would leave the scores unordered, and values above 0
    # add up to +inf, then NaN); a beam's w continuations are w distinct tokens (rows of
    # requests aborted in the plan are not read)
    bad = ~(tlps <= 0)
    if bad.any():
        raise ValueError(f"topk_logprobs row {int(np.argmax(bad.any(axis=1)))} holds "
                         f"NaN or a value above 0 (a log-probability is at most 0)")
    # the beam rows: the first sampled row of each live chunk whose request leads or is a
    # member of a beam group (read from the plan's own chunks: an id re-added since the plan
    # names another request)
    for req, _, r, end in chunk_rows(plan):
        if end == r or req.request_id in s._aborted_in_plan:
            continue
        g = s._group_of.get(req.request_id)
        if not isinstance(g, BeamGroup):
            continue
        if len(set(tids[r, :g.width].tolist())) != g.width:
            raise ValueError(f"topk_ids row {r} repeats a token among its beam's "
                             f"candidates")
        if k > 1 and bool((tlps[r, 1:] > tlps[r, :-1]).any()):
            # best first: a group narrower than num_topk reads the first w as its best
            raise ValueError(f"topk_logprobs row {r} is not best first "
                             f"(non-increasing)")
    return tids, tlps
