"""Parallel sampling (``n > 1``) and beam search on copy-on-write forks, in plain Python
(docs/DESIGN.md, "Forks at the step level").

``ForkStepScheduler`` extends the engine-step twin (``qualia.twin.step.StepScheduler``) with
request groups whose members share pages through ``Scheduler.fork``:

* ``add_request(..., n=k)``: the prompt is prefilled once.  The step whose chunk reaches the end of
  the prompt samples ``k`` rows from the prompt's last logits row (``logits_indices`` repeats that
  row, ``sampled_request_ids`` names the members); ``update`` then forks the parent into
  ``k - 1`` children, each continuing with its own first token.  The children share every page of
  the prompt, the partly filled last page included: the first decode of each copies that page
  (``plan.copies``).  Members decode and stop independently; when the last one stops, ``update``
  returns one ``FinishedGroup`` with the ``k`` outputs under the parent's id, in member order.
* ``add_request(..., beam_width=w)``: beam search as a policy over fork and finish, the policy
  of the dense reference ``qualia.model.DenseModel.beam_search``: ``w`` places hold live or
  finished beams.  Each live beam's row asks the backend for its ``plan.num_topk = w`` best next
  tokens with their log-probabilities.  When every live beam of the group is computed and has
  its candidates, the candidates (scored by cumulative log-probability; ties: the earlier beam,
  then the lower id) fill the ``w - finished`` free places in order; a kept candidate that is a
  stop token (eos unless ignored, or a stop id) or reaches ``max_new_tokens`` finishes a
  hypothesis.  A beam with no live continuation is finished (pages released), a beam with ``c``
  live continuations forks ``c - 1`` children and continues with the first.  The group ends when
  no beam is live; the result is the hypotheses best first (ties: finished first first).

Sampling is the backend's: ``qualia.sim.adapters.PlanModelSteps`` over
``qualia.model.PagedModelBackend`` runs the model's keyed sampler, which
draws row ``i`` keyed by ``(seed, sampled_request_ids[i], position)``; the members of a
group have distinct ids (``FinishedGroup.member_ids``), so the dense reference
``DenseModel.generate(..., sampling=..., request_id=member)`` draws the same tokens whatever the
batching, preemption or recomputation.

When no request slot or plan row is free for a child at fork time, the child waits as an
ordinary request holding its prompt and first token (it is admitted later, sharing the prompt's
full pages through the prefix cache): slower, never wrong.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, fields
from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from qualia._types import FinishedGroup, FinishedRequest, RequestState
from qualia.errors import StepError
from qualia.twin.seed import U32_MAX, _u32, _u64, exact_int
from qualia.twin.step import StepPlan, StepScheduler, _Req, _stops

__all__ = ["ForkStepScheduler", "ForkStepPlan", "FinishedGroup", "run_forks", "CHILD_BASE"]

#: internal ids of children start here and count up, skipping ids in use
CHILD_BASE = 1 << 63


@dataclass
class _Group:
    kind: str                   # "n" or "beam"
    parent: int
    width: int
    max_new: int
    members: List[int] = field(default_factory=list)    # "n": member j's id; "beam": live beams
    forked: bool = False
    results: Dict[int, Tuple[List[int], str]] = field(default_factory=dict)
    hyps: List[Tuple[float, int, List[int], str]] = field(default_factory=list)
    cum: Dict[int, float] = field(default_factory=dict)  # beam id -> cumulative log-probability
    cand: Dict[int, Tuple[List[int], List[float]]] = field(default_factory=dict)


@dataclass
class ForkStepPlan(StepPlan):
    """A ``StepPlan`` that may repeat a logits row (the members of an ``n`` group sampling the
    prompt's last row) and may ask for candidates (beam rows)."""

    #: the backend returns this many best tokens per row (0: no beam row in the plan)
    num_topk: int = 0


def _group_size(value, name: str, max_num_seqs: int) -> int:
    """``n`` or ``beam_width``: an integer (``__index__``, numpy integers too; not a bool)
    in [1, max_num_seqs], as an exact int (an int subclass's own comparisons never run)."""
    v = exact_int(value, name)
    if not 1 <= v <= max_num_seqs:
        raise ValueError(f"{name} must be in [1, max_num_seqs={max_num_seqs}], got {v}")
    return v


class ForkStepScheduler(StepScheduler):
    """``StepScheduler`` with ``n`` and ``beam_width`` groups over copy-on-write forks."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self._groups: Dict[int, _Group] = {}
        self._group_of: Dict[int, _Group] = {}      # member id -> its group
        self._reserved: set = set()                 # child ids handed out, not yet requests
        self._child_ids = itertools.count(CHILD_BASE)
        self.forks = 0
        self.fork_fallbacks = 0
        self.parked = 0
        self.pages_copied = 0
        # live beams that have their candidates and hold nothing (no slot, row or pages): out
        # of the queues until their group selects
        self._parked: Dict[int, _Req] = {}

    # -- requests in -------------------------------------------------------------------------------
    def add_request(self, request_id, prompt_tokens, *, max_new_tokens, n=1, beam_width=None,
                    **kw) -> None:
        rid = _u64(request_id, "request_id")
        n = _group_size(n, "n", self.max_num_seqs)
        if beam_width is not None:
            beam_width = _group_size(beam_width, "beam_width", self.max_num_seqs)
            if n != 1:
                raise ValueError("beam search returns beam_width hypotheses: leave n at 1")
            if self.vocab_size is not None and beam_width > self.vocab_size:
                # a beam row's w candidates are distinct tokens of the vocabulary
                raise ValueError(f"beam_width must be at most vocab_size={self.vocab_size}, "
                                 f"got {beam_width}")
        if beam_width is not None:
            # the w beams are computed side by side: the prompt's full pages once (shared) and
            # each beam's own tail must fit the pool together, or the group never selects
            prompt_tokens = self.facade._load_tokens(prompt_tokens)
            pt = self.page_tokens
            new = _u32(max_new_tokens, "max_new_tokens")
            n_prompt = len(prompt_tokens)
            tail = -(-(n_prompt + new - 1) // pt) - n_prompt // pt
            need = n_prompt // pt + beam_width * tail
            if n_prompt and new and need > self.facade.num_pages:
                raise StepError.NeverFits(None, f"{beam_width} beams need {need} pages side by "
                                                f"side, the pool has {self.facade.num_pages}")
        # the queue entries this call takes, read by the capacity check once the arguments are
        # resolved: restored, not deleted, afterwards, so that an add_request made by user code
        # while they resolve (a prompt iterator, an __index__) leaves this call's count in place
        outer = self.__dict__.get("_entries_adding")
        self._entries_adding = n if beam_width is None else beam_width
        try:
            super().add_request(rid, prompt_tokens, max_new_tokens=max_new_tokens, **kw)
        finally:
            if outer is None:
                self.__dict__.pop("_entries_adding", None)
            else:
                self._entries_adding = outer
        r = self._reqs[rid]
        if n > 1 or beam_width is not None:
            g = _Group("n" if beam_width is None else "beam", rid,
                       n if beam_width is None else beam_width, r.max_new_tokens, [rid])
            if g.kind == "n":
                for _ in range(1, n):
                    cid = self._new_child_id()
                    self._reserved.add(cid)
                    g.members.append(cid)
            self._groups[rid] = g
            self._group_of[rid] = g

    def group_members(self, request_id) -> List[int]:
        """The member ids of a queued or running ``n`` group (what the sampler keys on), or of
        the live beams of a beam group."""
        g = self._groups.get(_u64(request_id, "request_id"))
        if g is None:
            raise StepError.UnknownRequest(None, f"no group {request_id}")
        return list(g.members)

    def has_unfinished(self) -> bool:
        return super().has_unfinished() or bool(self._parked)

    def _taken(self, rid: int) -> bool:
        # every member id of a live group is taken (reserved, running, waiting or stopped),
        # until the group's result is returned
        return (rid in self._reqs or rid in self._reserved or rid in self._group_of
                or rid in self._groups)

    def _entries_used(self) -> int:
        # a group (n or beam) holds its width of queue entries from add_request until its result
        # is returned: an n group's reserved children and stopped members (the core keeps their
        # outputs there), a beam group's live beams and hypotheses (the core keeps each
        # hypothesis's tokens in one of them)
        return (sum(1 for rid in self._reqs if rid not in self._group_of)
                + sum(g.width for g in self._groups.values()))

    def _new_child_id(self) -> int:
        while True:
            cid = next(self._child_ids)
            if not self._taken(cid):
                return cid

    def abort(self, request_id) -> None:
        """Abort a request; a group's id aborts every member."""
        rid = _u64(request_id, "request_id")
        self._enter()       # the core owns the scheduler before it looks the id up
        g = self._groups.get(rid)
        if g is None:
            if rid in self._group_of:
                raise StepError.UnknownRequest(None, f"request {rid} is a group member: abort "
                                                     f"the group ({self._group_of[rid].parent})")
            super().abort(rid)
            return
        for m in [m for m in g.members if m in self._reqs]:
            super().abort(m)
        self._drop_group(g)

    def _drop_group(self, g: _Group) -> None:
        for m in [m for m, x in self._group_of.items() if x is g]:
            del self._group_of[m]
        self._reserved.difference_update(g.members)
        self._groups.pop(g.parent, None)

    # -- one step out ------------------------------------------------------------------------------
    def _lower(self, chunks, new, preempted, cached) -> StepPlan:
        plan = super()._lower(chunks, new, preempted, cached)
        logits, sampled = [], []
        topk = 0
        for li, rid in zip(plan.logits_indices.tolist(), plan.sampled_request_ids.tolist()):
            g = self._group_of.get(rid)
            if g is not None and g.kind == "n" and not g.forked:
                logits.extend([li] * len(g.members))     # every member samples this row
                sampled.extend(g.members)
                continue
            logits.append(li)
            sampled.append(rid)
            if g is not None and g.kind == "beam":
                topk = max(topk, g.width)
        parts = {f.name: getattr(plan, f.name) for f in fields(StepPlan)}
        parts["logits_indices"] = _ro(np.array(logits, dtype=np.int32))
        parts["sampled_request_ids"] = _ro(np.array(sampled, dtype=np.uint64))
        out = ForkStepPlan(**parts, num_topk=topk)
        self._plan = out
        return out

    def _owe(self, r: _Req, copies: np.ndarray) -> None:
        super()._owe(r, copies)
        self.pages_copied += len(copies)      # made once, however often a plan lists it

    # -- tokens back -------------------------------------------------------------------------------
    def update(self, sampled_token_ids, topk_ids=None, topk_logprobs=None) -> List[Any]:
        """``StepScheduler.update``; a plan with beam rows (``num_topk > 0``) also takes each
        row's ``num_topk`` best ids and their log-probabilities (``[m, num_topk]`` arrays)."""
        if self._plan is None:
            raise StepError.NoPlan(None, "schedule() first")
        values = self._resolve_sampled(sampled_token_ids)    # user code runs here only
        topk = _resolve_topk(topk_ids, topk_logprobs)        # (and here)
        self._enter()
        return self._update_fork(values, *topk)

    def _update_fork(self, values, topk_ids, topk_logprobs, err=None) -> List[Any]:
        # checked against the plan pending now, then applied (StepScheduler._update's rule)
        values = self._check_sampled(values)
        plan = self._plan
        assert plan is not None
        m = len(plan.logits_indices)
        k = plan.num_topk if isinstance(plan, ForkStepPlan) else 0
        tids = tlps = np.zeros((0, 0))
        if k:
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
            limit = U32_MAX if self.vocab_size is None else self.vocab_size - 1
            if tids.size and (int(tids.min()) < 0 or int(tids.max()) > limit):
                raise ValueError(f"a topk token id is outside [0, {limit}]")
            tlps = tlps.astype(np.float64)
            # a log-probability is at most 0 (NaN would leave the scores unordered, and values
            # above 0 add up to +inf, then NaN); a beam's w continuations are w distinct tokens
            # (rows of requests aborted in the plan are not read)
            bad = ~(tlps <= 0)
            if bad.any():
                raise ValueError(f"topk_logprobs row {int(np.argmax(bad.any(axis=1)))} holds "
                                 f"NaN or a value above 0 (a log-probability is at most 0)")
            for r, rid in enumerate(plan.sampled_request_ids.tolist()):
                g = self._group_of.get(rid)
                if g is None or g.kind != "beam" or rid in self._aborted_in_plan:
                    continue
                if len(set(tids[r, :g.width].tolist())) != g.width:
                    raise ValueError(f"topk_ids row {r} repeats a token among its beam's "
                                     f"candidates")
                if k > 1 and bool((tlps[r, 1:] > tlps[r, :-1]).any()):
                    # best first: a group narrower than num_topk reads the first w as its best
                    raise ValueError(f"topk_logprobs row {r} is not best first "
                                     f"(non-increasing)")
        f = self.facade
        self._owed_applied()      # the plan listed every copy owed, and it is applied
        finished: List[Any] = []
        beams: List[_Group] = []
        qsl = plan.query_start_loc.tolist()
        li = plan.logits_indices.tolist()
        row = 0
        for i, (r, n) in enumerate(plan._chunks):
            first = row
            while row < m and li[row] == qsl[i + 1] - 1:
                row += 1
            if r.request_id in self._aborted_in_plan:
                continue
            r.unseen = False
            f.advance(r.request_id, n)
            r.num_computed += n
            if row == first:
                continue
            g = self._group_of.get(r.request_id)
            if g is None or (g.kind == "n" and g.forked):
                self._take(r, values[first], finished)
            elif g.kind == "n":
                self._fork_n(g, r, values[first:row], finished)
            else:
                g.cand[r.request_id] = (tids[first, :g.width].tolist(),
                                        tlps[first, :g.width].tolist())
                if g not in beams:
                    beams.append(g)
        for g in beams:
            self._select(g, finished)
        self._park_blocked_beams(len(plan.input_ids) == 0)
        self._plan = None
        self._aborted_in_plan = set()
        self._clear_deferred_rows()
        return finished

    def _run_step(self, execute, plan: StepPlan) -> List[Any]:
        """``StepScheduler.run``'s step for backends whose ``execute_step`` returns the sampled
        ids, or ``(sampled, topk_ids, topk_logprobs)`` when the plan has beam rows; ``finished``
        then holds ``FinishedRequest`` and ``FinishedGroup`` records in the order they
        finished."""
        try:
            out = execute(plan)
            ids, tk, tl = out if isinstance(out, tuple) else (out, None, None)
            return self._update_fork(self._resolve_sampled(ids), *_resolve_topk(tk, tl))
        except BaseException:
            if self._plan is plan:      # refused before anything changed
                self._discard()
            raise

    def _note(self, r: _Req, tok: int) -> None:
        f = self.facade
        if r.running:
            f._note_token(f._find(r.request_id), len(r.tokens), tok)
        r.tokens.append(tok)
        if self._parked.pop(r.request_id, None) is not None:
            self._enqueue(r)        # a parked beam continues: it has a token to compute

    def _unqueue(self, r: _Req) -> None:
        if self._parked.pop(r.request_id, None) is None:
            self._waiting.remove(r)

    def _has_cand(self, r: _Req) -> bool:
        # a live beam whose candidates wait for its group's selection
        g = self._group_of.get(r.request_id)
        return g is not None and g.kind == "beam" and r.request_id in g.cand

    def _pick_victim(self, pool: List[_Req]) -> _Req:
        # a computed beam waiting for its group (it keeps its candidates) goes before anything
        # that still computes
        ready = [q for q in pool if self._has_cand(q)]
        return super()._pick_victim(ready or pool)

    def _preempt(self, r: _Req) -> None:
        if self._has_cand(r):
            self._park(r)
        else:
            super()._preempt(r)

    def _park(self, r: _Req) -> None:
        # out of the running list with its candidates: pages back (full pages stay cached)
        self._stop_running(r)
        self._parked[r.request_id] = r
        self.parked += 1

    def _finish_member(self, r: _Req) -> None:
        if r.running:
            self._stop_running(r)
        else:
            self._unqueue(r)
        del self._reqs[r.request_id]
        self._finished_since.append(r.request_id)

    def _take(self, r: _Req, tok: int, finished: List[Any]) -> None:
        # one sampled token for a plain request or a forked member of an "n" group
        self._note(r, tok)
        reason = self._stop_reason(r, tok)
        if reason is None:
            return
        out = r.tokens[r.prompt_len:]
        self._finish_member(r)
        g = self._group_of.get(r.request_id)
        if g is None:
            finished.append(FinishedRequest(r.request_id, np.array(out, dtype=np.uint32),
                                            reason))
            return
        g.results[r.request_id] = (out, reason)
        if len(g.results) == len(g.members):
            finished.append(FinishedGroup(
                g.parent, [np.array(g.results[m][0], dtype=np.uint32) for m in g.members],
                [g.results[m][1] for m in g.members], None, list(g.members)))
            self._drop_group(g)

    def _spawn(self, parent: _Req, cid: int) -> _Req:
        """A child of the running ``parent`` (its tokens so far): forked when a slot and a row
        are free, else queued as an ordinary request (admitted later through the cache)."""
        f = self.facade
        child = _Req(cid, list(parent.tokens), parent.prompt_len, parent.max_new_tokens,
                     parent.namespace, parent.priority, parent.arrival, parent.eos,
                     set(parent.stop), parent.ignore_eos)
        self._reserved.discard(cid)
        self._reqs[cid] = child
        if parent.running and self._rows_free and f.active_count < f.max_requests:
            if f._slots[f._find(parent.request_id)].state != RequestState.DECODE:
                f.complete_prefill(parent.request_id, 0)   # fork needs a decoding parent
            f.fork(parent.request_id, cid)
            child.running = True
            child.num_computed = parent.num_computed
            child.admitted = next(self._admissions)
            child.row = self._rows_free.pop(0)
            self._running.append(child)
            self._forked_since.append((cid, parent.request_id))
            self.forks += 1
        else:
            self._enqueue(child)
            self.fork_fallbacks += 1
        return child

    def _fork_n(self, g: _Group, parent: _Req, toks: List[int], finished: List[Any]) -> None:
        g.forked = True
        children = [self._spawn(parent, cid) for cid in g.members[1:]]
        for j, child in enumerate(children, start=1):
            self._group_of[child.request_id] = g
            self._take(child, toks[j], finished)
        self._take(parent, toks[0], finished)

    # -- beam search -------------------------------------------------------------------------------
    def _park_blocked_beams(self, idle: bool) -> None:
        # A beam group selects once every live beam has its candidates.  A computed beam whose
        # sibling waits would hold its slot, row and pages for nothing -- with several groups,
        # forever.  After a step that scheduled nothing (every running request is such a beam,
        # and the head of the queue did not fit), every running beam is parked: it keeps its
        # candidates and leaves the running list (full pages stay cached), so the next step
        # admits the head of the queue.  A parked beam is not queued: it needs nothing until
        # its group selects (docs/DESIGN.md, "Progress").
        if idle is False:
            return
        for g in list(self._groups.values()):
            if g.kind != "beam":
                continue
            for m in g.members:
                r = self._reqs[m]
                if r.running and r.num_computed == len(r.tokens):
                    self._park(r)

    def _select(self, g: _Group, finished: List[Any]) -> None:
        live = [self._reqs[b] for b in g.members]
        if not all(b.request_id in g.cand for b in live):
            return          # a beam is still being computed: select when all have candidates
        cands: List[Tuple[float, int, int, _Req]] = []
        for rank, b in enumerate(live):
            base = g.cum.get(b.request_id, 0.0)
            ids, lps = g.cand[b.request_id]
            cands.extend((base + lp, rank, int(tok), b) for tok, lp in zip(ids, lps))
        cands.sort(key=lambda c: (-c[0], c[1], c[2]))
        g.cand.clear()
        kept: List[Tuple[_Req, int, float]] = []
        for score, _, tok, b in cands[:g.width - len(g.hyps)]:
            out = b.tokens[b.prompt_len:] + [tok]
            if _stops(b, tok) or len(out) >= g.max_new:
                g.hyps.append((score, len(g.hyps), out, "stop" if _stops(b, tok) else "length"))
            else:
                kept.append((b, tok, score))
        if not kept:
            for b in live:
                self._finish_member(b)
            hyps = sorted(g.hyps, key=lambda h: (-h[0], h[1]))
            finished.append(FinishedGroup(
                g.parent, [np.array(h[2], dtype=np.uint32) for h in hyps],
                [h[3] for h in hyps], [h[0] for h in hyps], []))
            self._drop_group(g)
            return
        # beams with no live continuation go first (their slots and rows free up for the forks)
        users = {b.request_id for b, _, _ in kept}
        for b in live:
            if b.request_id not in users:
                self._finish_member(b)
                del self._group_of[b.request_id]
                g.cum.pop(b.request_id, None)
        # then each kept beam forks its extra continuations before noting its own token
        seen = set()
        order: List[Tuple[_Req, int, float]] = []
        for b, tok, score in kept:
            if b.request_id in seen:
                child = self._spawn(b, self._new_child_id())
                self._group_of[child.request_id] = g
                order.append((child, tok, score))
            else:
                seen.add(b.request_id)
                order.append((b, tok, score))
        g.members = []
        for r, tok, score in order:
            self._note(r, tok)
            g.cum[r.request_id] = score
            g.members.append(r.request_id)


def _resolve_topk(topk_ids, topk_logprobs) -> Tuple[Any, Any, Optional[Exception]]:
    # update()'s candidates as private arrays, before any state is read (user code --
    # __array__, sequences -- runs here only); a conversion error is raised later, and only
    # when the plan has beam rows (a plan without them ignores the arguments)
    if topk_ids is None or topk_logprobs is None:
        return None, None, None
    try:
        return np.array(topk_ids), np.array(topk_logprobs), None
    except Exception as exc:
        return None, None, exc


def _ro(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


def run_forks(sched: ForkStepScheduler, backend, max_steps: int = 100000):
    """Drive ``sched`` to completion; returns (finished, peak pages held by requests, steps).
    Pages are counted after each ``schedule`` (the step's pages are reserved then)."""
    finished: List[Any] = []
    peak = 0
    steps = 0
    f = sched.facade
    while sched.has_unfinished() and steps < max_steps:
        plan = sched.schedule()
        peak = max(peak, f.num_pages - f.free_pages)
        out = backend.execute_step(plan)
        finished.extend(sched.update(*out) if isinstance(out, tuple) else sched.update(out))
        steps += 1
    return finished, peak, steps
