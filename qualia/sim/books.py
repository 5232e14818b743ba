"""The simulator's books: what one engine's steps did, counted from the plans and the
scheduler's reads (:class:`~qualia.sim.report.Counters`), the timeline of the run
(:class:`~qualia.sim.report.Timeline`), and the page figures with and without sharing.

Per running sequence (a request, or one member of a group) the books keep its tokens with K/V
after the last plan it was in, and the pages that many tokens take on their own (the
non-sharing count); per sequence that left the running set (preempted, parked) what it had
computed (its recompute, when it resumes); and admissions so far.  A child forked by an
``update()`` (an ``n`` group's member, a beam's extra continuation) runs and holds its parent's
pages before its first plan (alone, a shared page its siblings copied away from): it is counted
from the plan that names it among ``fork_child_ids``, with its parent's tokens with K/V (the
parent's last plan's), so the non-sharing figure never leaves out a sequence that holds pages.
A child queued at its fork (no slot or row free) holds nothing until it is admitted.  A beam
parked outside any plan (after a plan that scheduled nothing) leaves the count, as a preempted
one does.  The pages held, which the engine reads after each schedule, leave out the sources of
copies owed that no request holds any more (:meth:`Books.copy_holds`), so the pages held never
exceed the non-sharing count: both are over the running sequences' block tables.

The cost of a step.  Without forks, a sequence enters the running set only by an admission
(``new_request_ids``) and leaves it only by finishing or a preemption, so a plan with none of
those events, no prefill token and the same request ids as the plan before it (compared as
bytes) is a *decode step of the same sequences*: each sequence's length grows by one.  Such a
step is booked in O(1): the sum of the plan's ``seq_lens`` (:attr:`Books.context`, what the
modeled clock costs a decode step by) grows by the number of sequences, and their pages
without sharing by the sequences whose length crosses a page boundary, read from a count of
the sequences by ``(seq_len - 1) % page_tokens`` taken when the lengths were last read; its
tokens are counted from the context's growth when the books settle.  Its timeline row, when
the step also took no arrival and finished nothing, takes its cached pages from the free pages
(see :meth:`Books.book`).  Any other step reads its ``seq_lens`` (the sums and that count,
again; in Python for a short plan, with numpy for a long one), the cache's counters, and books
its events one by one; its running set is worked out with dictionary and set operations over
the plan's ids only when a preemption happened or a running sequence is left out of a plan
(the plan has fewer sequences than are running).  With forks every step is booked sequence by
sequence.

:class:`TokenTimes` keeps when each sampled token was delivered, as runs of steps that sampled
one set of ids, and gives many requests' token times at once.
"""

from __future__ import annotations

import itertools
from array import array
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np

from ..errors import StepError
from .report import Counters, Timeline

__all__ = ["Books", "TokenTimes"]


class Books:
    """The books of one engine whose pool has ``num_pages`` pages of ``page_tokens`` tokens;
    ``n``: the size of its ``n`` groups (1: none); ``forking``: its requests are groups (``n >
    1`` or beam search; default: ``n > 1``).  A step is booked by :meth:`book`, once its
    plan is computed and updated.  The token counters and the peaks of pages used, running
    and waiting requests are up to date once :meth:`settle` has run; every other figure after
    each step."""

    def __init__(self, num_pages: int, page_tokens: int, n: int = 1, *,
                 forking: Optional[bool] = None) -> None:
        self.num_pages = int(num_pages)
        self.page_tokens = int(page_tokens)
        self.n = int(n)
        self.forking = self.n > 1 if forking is None else bool(forking)
        self.counters = Counters()
        self.timeline = Timeline()
        # the counters written in place: the typo guard of Counters is for their readers, and
        # costs a Python call per write
        self._c = self.counters.__dict__
        tl = self.timeline
        self._rows = (tl.step.append, tl.running.append, tl.waiting.append,
                      tl.pages_used.append, tl.pages_cached.append, tl.hit_rate.append)
        self._settled = 0  # timeline rows whose peaks are counted
        #: Without forks: the last step booked was a decode step of the sequences of the plan
        #: before it (one token each, each sampled, no copy).
        self.steady = False
        # the last timeline row's waiting requests, pages only cached and hit rate
        self._waiting = self._cached = 0
        self._hit_rate = 0.0
        self._seq_of: Dict[int, int] = {}  # with forks: every running sequence's length
        self._unshared = 0  # with forks: sum of ceil(seq_len / page_tokens) over self._seq_of
        self._left: Dict[int, int] = {}
        self._admitted: Dict[int, int] = {}
        self._parked_seen = 0
        self._awaiting_first: Dict[int, Any] = {}  # admitted, no token sampled yet
        #: Without forks: the sum of the last plan's ``seq_lens`` (None with forks).
        self.context: Optional[int] = None if self.forking else 0
        # Without forks.  The last plan's sequences: their request ids (as bytes), their
        # lengths when last read (the decode steps since, each adding one to every length,
        # are the context's growth since over their number), their pages without sharing,
        # and how many cross a page boundary at each decode step from then on, in turn.  The
        # running sequences the last plan left out (_off), with their lengths and pages.
        self._key: Optional[bytes] = None
        self._key_dtype: Any = np.dtype(np.uint64)
        self._seqs: Any = []  # a list, or an int64 array for a long plan
        self._n = 0  # sequences in the last plan
        self._read_context = 0  # the context when the lengths were last read
        self._folded = 0  # the context up to which decode steps' tokens are counted (_fold)
        self._pages = 0
        self._crossings: Iterator[int] = itertools.repeat(0)
        self._off: Dict[int, int] = {}
        self._off_pages = 0

    def count_forks(self, s, plan) -> None:
        """The fork counters of scheduler ``s``, after the update of ``plan``."""
        c = self.counters
        c.forks = int(getattr(s, "forks", 0))
        c.fork_fallbacks = int(getattr(s, "fork_fallbacks", 0))
        parked = int(getattr(s, "parked", 0))
        if parked != self._parked_seen:
            self._parked_seen = parked
            if not len(plan.input_ids):  # parked by this update (a preemption is in the plan)
                self._leave_parked(s)
        c.beams_parked = parked

    def _leave_parked(self, s) -> None:
        """After the update of a plan that scheduled nothing, which parks every running beam
        that waits for a sibling outside any plan: the sequences that hold no pages now (the
        parked beams) leave the running set, what they computed kept for their recompute.  (A
        beam parked by a preemption is named by the plan's ``preempted_request_ids``.)"""
        seq_of, left, pt = self._seq_of, self._left, self.page_tokens
        for rid in list(seq_of):
            try:
                holds = len(s.request_pages(rid))
            except StepError.UnknownRequest:  # pragma: no cover - finished: the next plan
                continue  # names it
            if not holds:
                seq = left[rid] = seq_of.pop(rid)
                self._unshared -= -(-seq // pt)

    @staticmethod
    def copy_holds(s, plan) -> int:
        """The pages that ``plan``'s copies alone hold right after its schedule on scheduler
        ``s``: sources of copies owed that no request's block table holds any more.  A copy
        owed holds its source until the plan is applied (docs/DESIGN.md, "Copies owed"), even
        when the schedule that made the copy preempted the source's last holder; in the
        engine (no plan discarded, no abort) that is the only way a page is held by no
        request, so it is read only for a plan with copies and preemptions."""
        sources = set(plan.copies["src_page"].tolist())
        for rid in s.requests():
            if not sources:
                break
            sources.difference_update(s.request_pages(rid).tolist())
        return len(sources)

    def book(self, plan, held: int, running: int, live: Dict[int, Any], step: int, s, f,
             backlog: int, quiet: bool = False) -> Sequence[Any]:
        """The books of step ``step``, its plan ``plan`` computed and updated (``held``: pages
        requests held right after the schedule, ``running``: sequences running then;
        ``live``: the engine's record of each request not yet completed, by id): tokens,
        admissions, hits, preemptions, pages with and without sharing, and the step's
        timeline row but its time (:attr:`Timeline.t`, which the caller appends: the serving
        clock at the step's end).  The row holds the reads of scheduler ``s`` over facade
        ``f`` after the step's update (running and waiting requests, pages used and only
        cached, the prefix cache's hit rate so far), with ``backlog`` requests due that wait
        in the engine.  Returns the records of the requests that got their first token.

        ``quiet``: the step took no arrival and its update finished no request.  Without
        forks, a quiet decode step of the last plan's sequences admits, preempts and releases
        nothing: the queue and the cache's lookups are as they were, and its only change to
        the cached pages is what its allocations reclaimed, which an allocation does only for
        what the free pages lack.  Its pages only cached are then the smaller of the last
        row's and the free pages, read without ``cache_stats()``."""
        if self.forking:
            firsts = self._record_each(plan, held, live, step)
            self.count_forks(s, plan)
            self._row(step, s, f, backlog)
            return firsts
        key = plan.request_ids.tobytes()
        fin, pre, new = (plan.finished_request_ids, plan.preempted_request_ids,
                         plan.new_request_ids)
        prefill = plan.num_prefill_tokens
        c = self._c
        if held > c["peak_held_pages"]:
            c["peak_held_pages"] = held
        if (key == self._key and not prefill and plan.num_decode_tokens == self._n
                and not (len(fin) or len(pre) or len(new))):
            # a decode step of the last plan's sequences: one token each, each sampled (no
            # copy: copies come from forks); its tokens are counted from the context's growth
            self.steady = True
            cross = next(self._crossings)
            self.context += self._n  # type: ignore[operator]
            if cross:
                self._pages = pages = self._pages + cross
                unshared = pages + self._off_pages
                if unshared > c["peak_unshared_pages"]:  # the first step with the most
                    c["peak_unshared_pages"] = unshared
                    c["pages_saved_at_peak"] = unshared - held
            if not quiet:
                self._row(step, s, f, backlog)
                return ()
            rows = self._rows
            free = f.free_pages
            cached = self._cached
            if free < cached:
                self._cached = cached = free
            rows[0](step)
            rows[1](s.num_running)
            rows[2](self._waiting)
            rows[3](self.num_pages - free)
            rows[4](cached)
            rows[5](self._hit_rate)
            return ()
        self.steady = False
        if key != self._key or len(fin) or len(pre) or len(new):
            self._events(plan, key, fin, pre, new, live, running)
        self._fold()
        self._read_lens(plan.seq_lens)
        n_tokens = len(plan.input_ids)
        prefill, decode = int(prefill), int(plan.num_decode_tokens)
        c["prefill_tokens"] += prefill
        c["decode_tokens"] += decode
        if prefill and decode:
            c["mixed_steps"] += 1
        copies = len(plan.copies)
        if copies:
            c["pages_copied"] += copies
        c["scheduled_tokens"] += n_tokens
        if n_tokens > c["max_plan_tokens"]:
            c["max_plan_tokens"] = n_tokens
        c["sampled_tokens"] += len(plan.logits_indices)
        unshared = self._pages + self._off_pages
        if unshared > c["peak_unshared_pages"]:  # the first step with the most
            c["peak_unshared_pages"] = unshared
            c["pages_saved_at_peak"] = unshared - held
        self._row(step, s, f, backlog)
        # a request's first token is sampled by the row of its prompt's last token
        return self._firsts(plan, step) if prefill and self._awaiting_first else ()

    def _row(self, step: int, s, f, backlog: int) -> None:
        """The timeline row of step ``step`` but its time, read (see :meth:`book`)."""
        stats = f.cache_stats()
        lookups = stats.lookup_tokens
        self._waiting = waiting = s.num_waiting + backlog
        self._cached = cached = stats.reclaimable_pages
        self._hit_rate = hit_rate = stats.hit_tokens / lookups if lookups else 0.0
        rows = self._rows
        rows[0](step)
        rows[1](s.num_running)
        rows[2](waiting)
        rows[3](self.num_pages - f.free_pages)
        rows[4](cached)
        rows[5](hit_rate)

    def settle(self) -> None:
        """Bring the figures kept for many steps at once up to date: the tokens of the decode
        steps of the last plan's sequences (decoded, scheduled and sampled), and the peaks of
        pages used, running and waiting requests of the timeline rows added since the last
        call."""
        self._fold()
        tl = self.timeline
        at, self._settled = self._settled, len(tl.step)
        if at == self._settled:
            return
        c = self._c
        for peak, column in (("peak_pages", tl.pages_used), ("peak_running", tl.running),
                             ("peak_waiting", tl.waiting)):
            top = int(max(column[at:] if at else column))
            if top > c[peak]:
                c[peak] = top

    def _fold(self) -> None:
        """Without forks: count the tokens of the decode steps of the last plan's sequences
        since the last call (decoded, scheduled and sampled): the growth of the context."""
        if self.context is None:
            return
        decoded, self._folded = self.context - self._folded, self.context
        if decoded:
            c = self._c
            c["decode_tokens"] += decoded
            c["scheduled_tokens"] += decoded
            c["sampled_tokens"] += decoded

    def _read_lens(self, seq_lens) -> None:
        """Without forks: read a plan's ``seq_lens`` (see the module docstring)."""
        pt = self.page_tokens
        n = len(seq_lens)
        # a sequence of phase (seq_len - 1) % pt crosses a page boundary at the (pt -
        # phase)-th decode step from here, and every pt-th one after
        if n < 64:  # a short plan: Python ints beat numpy's per-call cost
            seqs = seq_lens.tolist()
            by_phase = [0] * pt
            pages, up = 0, pt - 1
            for seq in seqs:
                seq += up
                pages += seq // pt
                by_phase[seq % pt] += 1
            self.context = sum(seqs)
        else:
            seqs = seq_lens.astype(np.int64)
            page_of, phase = np.divmod(seqs + (pt - 1), pt)
            pages = int(page_of.sum())
            self.context = int(seqs.sum())
            by_phase = np.bincount(phase, minlength=pt).tolist()
        self._seqs, self._n, self._read_context = seqs, n, self.context
        self._folded = self.context
        # the sequences crossing a page boundary at each decode step from here on, in turn
        self._pages, self._crossings = pages, itertools.cycle(by_phase[::-1])

    def _events(self, plan, key: bytes, fin, pre, new, live: Dict[int, Any],
                running: int) -> None:
        """Without forks: a plan whose events (finished, preempted, admitted) or running set
        differ from the plan before it (``running``: sequences running right after its
        schedule)."""
        c = self._c
        left, admitted = self._left, self._admitted
        ids = plan.request_ids
        if len(pre) or self._off or len(ids) != running:
            self._running_set(plan, key, fin, pre, new, live)
            return
        # every running sequence is in the plan, and none was in a plan before but this one's
        # admissions
        for rid in fin.tolist():  # stopped since the last plan
            left.pop(rid, None)
            admitted.pop(rid, None)
        if len(new):
            self._admit(plan, new.tolist(), ids, live)
        if len(ids) > c["max_plan_seqs"]:
            c["max_plan_seqs"] = len(ids)
        self._key, self._key_dtype = key, ids.dtype

    def _running_set(self, plan, key: bytes, fin, pre, new, live: Dict[int, Any]) -> None:
        """:meth:`_events` of a plan after a preemption, or with a running sequence left out
        of it or of the plan before: the running set, sequence by sequence."""
        c = self._c
        left, admitted = self._left, self._admitted
        # the running set before the plan
        prev = np.frombuffer(self._key, dtype=self._key_dtype).tolist() if self._key else []
        lens = self._seqs if isinstance(self._seqs, list) else self._seqs.tolist()
        grown = (self.context or 0) - self._read_context  # by the decode steps since
        d = grown // self._n if self._n else 0
        seq_of = dict(zip(prev, [seq + d for seq in lens] if d else lens))
        if self._off:
            seq_of.update(self._off)
        for rid in fin.tolist():  # stopped since the last plan
            seq_of.pop(rid, None)
            left.pop(rid, None)
            admitted.pop(rid, None)
        if len(pre):
            preempted = pre.tolist()
            c["preemptions"] += len(preempted)
            for rid in preempted:  # what it computed: its last plan's
                seq = seq_of.pop(rid, None)
                if seq is not None:
                    left[rid] = seq
        ids = plan.request_ids.tolist()
        if len(new):
            self._admit(plan, new.tolist(), plan.request_ids, live)
        if len(ids) > c["max_plan_seqs"]:
            c["max_plan_seqs"] = len(ids)
        planned = set(ids)
        if left:
            for rid in planned.difference(seq_of):  # in the running set from this plan on
                left.pop(rid, None)
        seq_of.update(zip(ids, plan.seq_lens.tolist()))
        if len(seq_of) == len(planned):
            self._off, self._off_pages = {}, 0
        else:  # a running sequence this plan left out keeps its last plan's length
            pt = self.page_tokens
            self._off = {rid: seq_of[rid] for rid in seq_of.keys() - planned}
            self._off_pages = sum(-(-seq // pt) for seq in self._off.values())
        self._key, self._key_dtype = key, plan.request_ids.dtype

    def _admit(self, plan, new: List[int], ids, live: Dict[int, Any]) -> None:
        """The admissions of a plan (``new``, its ``new_request_ids``; ``ids``, its
        ``request_ids`` array): hits, cached tokens, the recompute of a resumed request."""
        c = self._c
        left, admitted = self._left, self._admitted
        n, k = len(ids), len(new)
        if ids[n - k:].tolist() == new:  # admissions come last in a plan
            at: Any = range(n - k, n)
        else:  # pragma: no cover - a scheduler that orders them otherwise
            index = {rid: i for i, rid in enumerate(ids.tolist())}
            at = [index[rid] for rid in new]
        qsl, positions = plan.query_start_loc, plan.positions
        for rid, i in zip(new, at):
            hit = int(positions[qsl[i]])  # the tokens found cached: where it starts computing
            lv = live.get(rid)
            if lv is not None and lv.first_step < 0:
                self._awaiting_first[rid] = lv
            c["admissions"] += 1
            if hit:
                c["prefix_hits"] += 1
                c["cached_tokens"] += hit
            times = admitted[rid] = admitted.get(rid, 0) + 1
            if times > 1:  # resumed after a preemption: what it computed before, less
                c["resumed"] += 1  # what the cache kept, is computed again
                c["tokens_recomputed"] += max(0, left.pop(rid, 0) - hit)

    def _firsts(self, plan, step: int) -> List[Any]:
        """The records of the admitted requests that got their first token in ``plan``."""
        firsts = []
        awaiting = self._awaiting_first
        sampled: Any = plan.sampled_request_ids.tolist()
        if len(awaiting) > 4:
            sampled = set(sampled)
        for rid in [r for r in awaiting if r in sampled]:
            got = awaiting.pop(rid)
            got.first_step = step
            firsts.append(got)
        return firsts

    def _record_each(self, plan, held: int, live: Dict[int, Any], step: int) -> List[Any]:
        """:meth:`record` with forks: every sequence of the plan booked on its own."""
        c = self.counters
        n_tokens = len(plan.input_ids)
        c.scheduled_tokens += n_tokens
        c.prefill_tokens += int(plan.num_prefill_tokens)
        c.decode_tokens += int(plan.num_decode_tokens)
        c.pages_copied += len(plan.copies)
        c.preemptions += len(plan.preempted_request_ids)
        c.max_plan_tokens = max(c.max_plan_tokens, n_tokens)
        c.max_plan_seqs = max(c.max_plan_seqs, len(plan.request_ids))
        if plan.num_prefill_tokens and plan.num_decode_tokens:
            c.mixed_steps += 1
        seq_of, left, admitted = self._seq_of, self._left, self._admitted
        pt = self.page_tokens
        unshared = self._unshared
        # the children forked by the last update run from their fork: each holds its parent's
        # pages, as many tokens with K/V as its parent's last plan left it (a running parent's
        # length is known: it was in a plan since it last entered the running set)
        for rid, parent in zip(plan.fork_child_ids.tolist(), plan.fork_parent_ids.tolist()):
            seq = seq_of.get(parent)
            if seq is None:  # pragma: no cover - a parent forks only while it runs
                continue
            seq_of[rid] = seq
            unshared += -(-seq // pt)
            left.pop(rid, None)
            admitted.setdefault(rid, 1)  # admitted by its fork (a later admission resumes it)
        for rid in plan.finished_request_ids.tolist():  # stopped since the last plan
            seq = seq_of.pop(rid, None)
            if seq is not None:
                unshared -= -(-seq // pt)
            left.pop(rid, None)
            admitted.pop(rid, None)
        for rid in plan.preempted_request_ids.tolist():  # what it computed: its last plan's
            seq = seq_of.pop(rid, None)
            if seq is not None:
                unshared -= -(-seq // pt)
                left[rid] = seq
        new = plan.new_request_ids.tolist()
        if new:
            n, k = len(plan.request_ids), len(new)
            ids = plan.request_ids.tolist()
            qsl = plan.query_start_loc
            if ids[n - k:] == new:  # admissions come last in a plan
                at = list(range(n - k, n))
            else:  # pragma: no cover - a scheduler that orders them otherwise
                index = {rid: i for i, rid in enumerate(ids)}
                at = [index[rid] for rid in new]
            hits = plan.positions[qsl[at]].tolist()
            for rid, hit in zip(new, hits):
                lv = live.get(rid)  # None: a group's child (queued at its fork, or parked)
                if lv is not None and lv.first_step < 0:
                    self._awaiting_first[rid] = lv
                c.admissions += 1
                if hit:
                    c.prefix_hits += 1
                    c.cached_tokens += hit
                times = admitted[rid] = admitted.get(rid, 0) + 1
                if times > 1:  # resumed after a preemption: what it computed before, less
                    c.resumed += 1  # what the cache kept, is computed again
                    c.tokens_recomputed += max(0, left.pop(rid, 0) - hit)
        for rid, seq in zip(plan.request_ids.tolist(), plan.seq_lens.tolist()):
            old = seq_of.get(rid)
            if old is not None:
                unshared -= -(-old // pt)
            else:
                left.pop(rid, None)
            seq_of[rid] = seq
            unshared += -(-seq // pt)
        self._unshared = unshared
        c.peak_held_pages = max(c.peak_held_pages, held)
        if unshared > c.peak_unshared_pages:
            c.peak_unshared_pages = unshared
            c.pages_saved_at_peak = unshared - held
        firsts = []
        awaiting = self._awaiting_first
        if awaiting:
            sampled = set(plan.sampled_request_ids.tolist())
            for rid in [r for r in awaiting if r in sampled]:
                got = awaiting.pop(rid)
                got.first_step = step
                firsts.append(got)
        c.sampled_tokens += len(plan.logits_indices)
        return firsts


class TokenTimes:
    """When each sampled token was delivered: at the end of the step that sampled it.

    :meth:`log` takes each step's ``sampled_request_ids`` and the serving time at its end; a
    step that samples the same ids as the step before it (the common case: the same sequences
    decoding) costs a comparison of bytes, for the log keeps *runs*, stretches of steps
    sampling one set of ids.  :meth:`take_all` gives, for each of many requests at once, the
    times of the tokens sampled under its ids before a given step, in time order: a completed
    request's, or its members' (each id taken once, after the last step that sampled it).  It
    works on every id of the runs logged since its last call with numpy: their ids sorted,
    each request's runs found by binary search, its token times gathered in one indexing."""

    def __init__(self) -> None:
        self._t = array("d")  # the serving time at the end of each step logged
        #: ``again(now)``: one step that sampled the ids of the step logged before it (which
        #: :meth:`log` finds by comparing them), at serving time ``now``.
        self.again = self._t.append
        self._array = np.zeros(0, dtype=np.float64)  # _t, when last indexed
        self._key: Optional[bytes] = None  # the sampled ids of the run going on
        self._dtype: Any = np.dtype(np.uint64)
        self._keys: List[bytes] = []  # each run's sampled ids...
        self._starts: List[int] = []  # ...and its first step
        # every (id, run) of the first _indexed runs whose id was not taken, by id then run
        self._indexed = 0
        self._ids = np.zeros(0, dtype=np.uint64)
        self._runs = np.zeros(0, dtype=np.int64)

    def __len__(self) -> int:
        """Steps logged."""
        return len(self._t)

    def log(self, sampled, now: float) -> None:
        """One step: the ids it sampled (a numpy array) and the serving time at its end."""
        key = sampled.tobytes()
        if key != self._key:
            self._key, self._dtype = key, sampled.dtype
            self._keys.append(key)
            self._starts.append(len(self._t))
        self._t.append(now)

    def _index(self) -> None:
        """Add the (id, run) pairs of the runs logged since the last call, and the times of
        the steps logged since, to the arrays :meth:`take_all` searches."""
        keys, a = self._keys, self._indexed
        if len(keys) > a:
            size = self._dtype.itemsize
            ids = np.frombuffer(b"".join(keys[a:]), dtype=self._dtype).astype(np.uint64)
            runs = np.repeat(np.arange(a, len(keys), dtype=np.int64),
                             [len(k) // size for k in keys[a:]])
            ids = np.concatenate([self._ids, ids])
            runs = np.concatenate([self._runs, runs])
            order = np.argsort(ids, kind="stable")  # the runs of an id stay in order
            self._ids, self._runs = ids[order], runs[order]
            self._indexed = len(keys)
        if len(self._t) > len(self._array):
            self._array = np.frombuffer(self._t, dtype=np.float64).copy()

    def take_all(self, requests: Sequence[Tuple[Sequence[int], int]]) -> List[np.ndarray]:
        """For each ``(ids, before)`` of ``requests``: the times (float64, in order) of the
        tokens sampled under ``ids`` in the steps before step ``before`` (a count of steps
        logged; see the class docstring)."""
        self._index()
        member = [rid for ids, _ in requests for rid in ids]
        if not member:
            return [np.zeros(0) for _ in requests]
        q = np.array(member, dtype=np.uint64)
        before = np.repeat(np.array([b for _, b in requests], dtype=np.int64),
                           [len(ids) for ids, _ in requests])
        # each id's (id, run) pairs: a stretch of the sorted pairs
        lo = np.searchsorted(self._ids, q, "left")
        count = np.searchsorted(self._ids, q, "right") - lo
        total = int(count.sum())
        first = np.cumsum(count) - count
        pair = np.repeat(lo - first, count) + np.arange(total)
        of = np.repeat(np.arange(len(q)), count)  # the id (of q) of each pair
        runs = self._runs[pair]
        # each pair's steps: its run's, up to the id's `before`
        bounds = np.array(self._starts + [len(self._t)], dtype=np.int64)
        start = bounds[runs]
        length = np.maximum(np.minimum(bounds[runs + 1], before[of]) - start, 0)
        tokens = np.bincount(of, weights=length, minlength=len(q)).astype(np.int64)
        n = int(length.sum())
        step = np.repeat(start - (np.cumsum(length) - length), length) + np.arange(n)
        times = self._array[step]
        times.flags.writeable = False  # what is taken is kept (a record's times)
        # the taken ids' pairs are dropped
        keep = np.ones(len(self._ids), dtype=bool)
        keep[pair] = False
        self._ids, self._runs = self._ids[keep], self._runs[keep]
        ends = np.cumsum(tokens).tolist()
        out, k = [], 0
        for ids, _ in requests:
            if len(ids) == 1:
                out.append(times[ends[k] - tokens[k]:ends[k]])
            else:
                got = np.concatenate([times[ends[j] - tokens[j]:ends[j]]
                                      for j in range(k, k + len(ids))]) if ids else np.zeros(0)
                got.sort(kind="stable")
                got.flags.writeable = False
                out.append(got)
            k += len(ids)
        return out

    def take(self, ids: Sequence[int], before: int) -> np.ndarray:
        """:meth:`take_all` of one request."""
        return self.take_all([(ids, before)])[0]
