"""The simulator's books: what one engine's steps did, counted from the plans and the
scheduler's reads (:class:`~qualia.sim.report.Counters`), the timeline of the run
(:class:`~qualia.sim.report.Timeline`), and the page figures with and without sharing.

Per running sequence (a request, or one member of a group) the books keep its tokens with K/V
after the last plan it was in, and the pages that many tokens take on their own (the
non-sharing count); per sequence that left the running set (preempted, parked) what it had
computed (its recompute, when it resumes); and admissions so far.  The children of ``n`` groups
sampled at their fork (a plan row under a member id that is not one of the plan's requests) and
in no plan since are kept apart with the tokens with K/V they share from their parent:
``update()`` forks them or queues them (no slot or row free); the forked ones hold pages before
their first plan (the last holder of a shared page its siblings copied away from), so they
count in the non-sharing figure too.
"""

from __future__ import annotations

from typing import Any, Dict, List

from .report import Counters, Timeline

__all__ = ["Books"]


class Books:
    """The books of one engine whose pool has ``num_pages`` pages of ``page_tokens`` tokens;
    ``n``: the size of its ``n`` groups (1: none)."""

    def __init__(self, num_pages: int, page_tokens: int, n: int = 1) -> None:
        self.num_pages = int(num_pages)
        self.page_tokens = int(page_tokens)
        self.n = int(n)
        self.counters = Counters()
        self.timeline = Timeline()
        self._seq_of: Dict[int, int] = {}
        self._unshared = 0  # sum of ceil(seq_len / page_tokens) over self._seq_of
        self._left: Dict[int, int] = {}
        self._admitted: Dict[int, int] = {}
        self._unseen: Dict[int, int] = {}
        self._parked_seen = 0
        self._awaiting_first: Dict[int, Any] = {}  # admitted, no token sampled yet

    def count_forks(self, s) -> None:
        """The fork counters of scheduler ``s``, after the step's update."""
        c = self.counters
        c.forks = int(getattr(s, "forks", 0))
        c.fork_fallbacks = int(getattr(s, "fork_fallbacks", 0))
        parked = int(getattr(s, "parked", 0))
        if parked != self._parked_seen:
            # beams parked by this update left the running set outside any plan: every
            # sequence not in a plan since is treated as gone (what it computed is kept for
            # its recompute); a running one is counted again from its next plan
            self._parked_seen = parked
            self._left.update(self._seq_of)
            self._seq_of.clear()
            self._unshared = 0
        c.beams_parked = parked

    def record(self, plan, held: int, running: int, live: Dict[int, Any], step: int) -> List[Any]:
        """The books of step ``step`` (``held``: pages requests held right after the schedule,
        ``running``: sequences running then; ``live``: the engine's record of each request
        not yet completed, by id): tokens, admissions, hits, preemptions, pages with and
        without sharing; returns the records of the requests that got their first token."""
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
        seq_of, left, admitted, unseen = self._seq_of, self._left, self._admitted, self._unseen
        pt = self.page_tokens
        unshared = self._unshared
        for rid in plan.finished_request_ids.tolist():  # stopped since the last plan
            unseen.pop(rid, None)
            seq = seq_of.pop(rid, None)
            if seq is not None:
                unshared -= -(-seq // pt)
            left.pop(rid, None)
            admitted.pop(rid, None)
        for rid in plan.preempted_request_ids.tolist():  # what it computed: its last plan's
            if rid in unseen:  # a forked child preempted before its first plan
                seq_of[rid] = unseen.pop(rid)
                unshared += -(-seq_of[rid] // pt)
                admitted.setdefault(rid, 1)
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
                unseen.pop(rid, None)  # a child queued at its fork, admitted now
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
        ids, seqs = plan.request_ids.tolist(), plan.seq_lens.tolist()
        for rid, seq in zip(ids, seqs):
            old = seq_of.get(rid)
            if old is not None:
                unshared -= -(-old // pt)
            else:
                left.pop(rid, None)
                if unseen.pop(rid, None) is not None:  # a forked child's first plan: it was
                    admitted.setdefault(rid, 1)  # admitted by its fork (a later one resumes)
            seq_of[rid] = seq
            unshared += -(-seq // pt)
        self._unshared = unshared
        # the forked children in no plan yet: running minus the sequences seen in plans; which
        # of the unseen children those are (the others wait, queued) is not known, so the
        # smallest count, never more than they hold
        extra = max(0, running - len(seq_of))
        if extra and unseen:
            unshared += sum(sorted(-(-seq // pt) for seq in unseen.values())[:extra])
        c.peak_held_pages = max(c.peak_held_pages, held)
        if unshared > c.peak_unshared_pages:
            c.peak_unshared_pages = unshared
            c.pages_saved_at_peak = unshared - held
        if self.n > 1:  # rows under a member id not planned: the forks this update makes
            in_plan = set(ids)
            forks = [(row, rid) for row, rid in zip(plan.logits_indices.tolist(),
                                                    plan.sampled_request_ids.tolist())
                     if rid not in in_plan]
            if forks:
                seq_at = dict(zip(plan.query_start_loc[1:].tolist(), seqs))  # end row -> seq
                for row, rid in forks:
                    unseen[rid] = seq_at[row + 1]
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

    def sample(self, s, f, step: int, now: float, backlog: int) -> None:
        """The timeline row of step ``step`` (at ``now`` on the serving clock) of scheduler
        ``s`` over facade ``f``; ``backlog``: requests due that wait in the engine."""
        tl = self.timeline
        stats = f.cache_stats()
        used = self.num_pages - int(f.free_pages)
        tl.append(step=step, t=now, running=int(s.num_running),
                  waiting=int(s.num_waiting) + backlog, pages_used=used,
                  pages_cached=int(stats.reclaimable_pages),
                  hit_rate=(stats.hit_tokens / stats.lookup_tokens
                            if stats.lookup_tokens else 0.0))
        c = self.counters
        c.peak_pages = max(c.peak_pages, used)
        c.peak_running = max(c.peak_running, int(s.num_running))
        c.peak_waiting = max(c.peak_waiting, int(s.num_waiting) + backlog)
