"""Pure-Python twin of the engine step (docs/DESIGN.md, "The engine step", "Forks at the step
level", "Beam search at the step level").

``StepScheduler`` is ``qualia.StepScheduler`` (``add_request`` / ``abort`` / ``schedule`` /
``update`` / ``discard_plan`` / ``run`` and its reads) written plainly, as a policy over the
facade twin ``qualia.twin.cache.Scheduler``: every page decision goes through the facade's verbs
(admit, reserve, advance, fork, finish) in the order the compiled core makes them, so the plans
agree with the core's array for array, physical page numbers included.  It is the executable
statement of the policy; the stateful differential tests drive both and compare every plan,
every result and every counter.

It is composed as the core's step is (core/step/): request entries (``_Req``), the waiting
queue, the running set with its block-table rows, the groups (``n`` groups and beam groups,
:mod:`qualia.twin.groups`), the copies owed, the plan and its lowering, one ``update`` and one
stop rule (``_Req.finish_reason``).

One step:

1. Running requests are served first: those with exactly one token left to compute (decodes),
   then those with more (prefill chunks), each group in admission order.  A request's chunk is
   ``min(tokens left, budget left, max_prefill_chunk)`` (the chunk cap applies to prefills).  When
   the pages for the chunk cannot be found (free plus reclaimable cached pages), the victim is
   preempted: of the running requests not yet scheduled in this step plus the current one, the
   one with the largest priority value, ties broken towards the most recently admitted (a
   computed beam waiting for its group goes first: it is parked).  A preempted request gives
   its pages back (its full pages stay cached), forgets its computed tokens and waits again,
   keeping its outputs and its arrival number.
2. If nothing was preempted, waiting requests are admitted in (priority, arrival) order until one
   does not fit (budget, ``max_num_seqs`` running requests, pages): the first that does not fit
   stops the admissions, so a large request is not overtaken forever.  An admission skips the
   longest cached run of full pages of its tokens (at least one token is left to compute).
3. ``update`` advances every scheduled request by its chunk (pages that filled enter the cache),
   and hands out the sampled rows: a plain request (or a forked member of an ``n`` group) takes
   its token and the stop rule applies -- ``max_new_tokens`` reached ("length"), the eos token
   unless ignored ("stop"), a stop token ("stop"); the parent of an ``n`` group not yet forked
   forks its children; a beam's row of candidates goes to its group, and each group whose live
   beams all have candidates selects.  Finished requests give their pages to the cache.

Aborts work in any state; a request aborted between ``schedule`` and ``update`` is skipped by the
update (its sampled row, if any, is ignored).
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass, field
from typing import Any, Deque, Dict, List, Optional, Set, Tuple, Union

import numpy as np

from qualia._types import (
    RUN_STATS_ROWS,
    STEP_STATS,
    STEP_TOTALS,
    CacheStats,
    FinishedGroup,
    FinishedRequest,
    RunResult,
)
from qualia.errors import BusyError, PrefixCacheError, SchedulerError, StepError, TableError
from qualia.twin.cache import M64, NS_MAX_BYTES
from qualia.twin.cache import Scheduler as _Facade
from qualia.twin.groups import (
    CHILD_BASE,
    BeamGroup,
    NGroup,
    check_topk,
    chunk_rows,
    fork_n,
    group_size,
    park,
    park_blocked,
    resolve_topk,
    select,
)
from qualia.twin.seed import (
    COPY_OP,
    _namespace_bytes,
    _u32,
    _u64,
    backend_attr,
    exact_int,
    token_limit,
)

__all__ = ["StepScheduler", "StepPlan", "MAX_STOP_TOKENS", "CHILD_BASE"]

#: Stop token ids a request may name (held per request in C, sized at construction).
MAX_STOP_TOKENS = 16
I32_MIN, I32_MAX = -(2**31), 2**31 - 1

Group = Union[NGroup, BeamGroup]


# -- request entries -------------------------------------------------------------------------------

@dataclass
class _Req:
    request_id: int
    tokens: List[int]
    prompt_len: int
    max_new_tokens: int
    namespace: bytes
    priority: int
    arrival: int
    eos: Optional[int]
    stop: Set[int]
    ignore_eos: bool
    running: bool = False
    num_computed: int = 0
    admitted: int = 0           # admission counter value (most recent = largest)
    row: int = -1
    unseen: bool = False        # admitted or resumed; in no applied plan since

    @property
    def num_outputs(self) -> int:
        return len(self.tokens) - self.prompt_len

    def stops(self, tok: int) -> bool:
        """A stop token of this request: eos unless ignored, or one of its stop ids."""
        return (self.eos is not None and tok == self.eos and not self.ignore_eos) or \
            tok in self.stop

    def finish_reason(self, tok: int, outputs: int, *, stop_first: bool = False
                      ) -> Optional[str]:
        """The stop rule: why the request finishes when ``tok`` is its ``outputs``-th output
        token -- ``max_new_tokens`` reached ("length"), a stop token ("stop") -- or None when it
        goes on.  A request checks the length first; a beam's kept candidate (``stop_first``)
        names its stop token first (core: ``step_take``, ``beam_select``)."""
        stop = self.stops(tok)
        if stop_first and stop:
            return "stop"
        if outputs >= self.max_new_tokens:
            return "length"
        return "stop" if stop else None

    def child(self, cid: int) -> "_Req":
        """A group member continuing this one: its tokens so far, its arrival and priority."""
        return _Req(cid, list(self.tokens), self.prompt_len, self.max_new_tokens,
                    self.namespace, self.priority, self.arrival, self.eos, set(self.stop),
                    self.ignore_eos)


# -- the plan --------------------------------------------------------------------------------------

@dataclass
class StepPlan:
    """One step's plan: what to compute and where, in the array conventions attention kernels
    take (see the module docstring of the core's ``StepPlan`` for each array).  A plan may
    repeat a logits row (the members of an ``n`` group sampling the prompt's last row) and may
    ask for candidates (beam rows: ``num_topk``)."""

    request_ids: np.ndarray
    query_start_loc: np.ndarray
    seq_lens: np.ndarray
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    logits_indices: np.ndarray
    sampled_request_ids: np.ndarray
    block_table: np.ndarray
    block_table_rows: np.ndarray
    changed_rows: np.ndarray
    kv_indptr: np.ndarray
    kv_indices: np.ndarray
    kv_last_page_len: np.ndarray
    copies: np.ndarray
    new_request_ids: np.ndarray
    preempted_request_ids: np.ndarray
    finished_request_ids: np.ndarray
    num_prefill_tokens: int
    num_decode_tokens: int
    num_cached_tokens: int
    page_tokens: int
    #: copy-on-write forks made since the previous plan: child ids and their parents' ids
    fork_child_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    fork_parent_ids: np.ndarray = field(default_factory=lambda: np.zeros(0, np.uint64))
    #: the backend returns this many best tokens per row (0: no beam row in the plan)
    num_topk: int = 0
    _chunks: List[Any] = field(default_factory=list, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.request_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


def _is_topk_triple(out: Any) -> bool:
    """A Python step backend returns the sampled ids (an array or a sequence of ints, a tuple of
    ints included) or ``(sampled, topk_ids, topk_logprobs)``: a tuple whose first item is not an
    integer, which must then be that triple."""
    if type(out) is not tuple or not out or isinstance(out[0], (int, np.integer)):
        return False
    if len(out) != 3:
        raise ValueError("execute_step returns the sampled ids, or (sampled, topk_ids, "
                         "topk_logprobs)")
    return True


def _i32(value: Any, name: str) -> int:
    """A signed 32-bit argument (the core's range): bool or non-integer -> TypeError, outside
    [-2**31, 2**31-1] -> OverflowError.  (``twin._int`` is for unsigned fields: it refuses every
    negative value.)"""
    v = exact_int(value, name)
    if not I32_MIN <= v <= I32_MAX:
        raise OverflowError(f"{name} must be in [-2**31, 2**31-1], got {v}")
    return v


class StepScheduler:
    """``qualia.StepScheduler`` in plain Python (``prefix_caching="auto"``), ``n`` groups and
    beam groups included."""

    def __init__(self, num_pages, page_tokens, logical_pages, max_num_seqs, *,
                 max_num_batched_tokens=2048, max_queued=None, max_prefill_chunk=None,
                 vocab_size=None, prefix_caching="auto", cache_key=None, max_namespaces=1024,
                 event_capacity=4096) -> None:
        # the plan's arrays are int32: refuse sizes whose page ids or offsets would not fit
        # (checked before the pool is built: the core checks before allocating it)
        nb = _u32(num_pages, "num_pages")
        budget = _u32(max_num_batched_tokens, "max_num_batched_tokens")
        if nb > I32_MAX + 1:
            raise ValueError(f"num_pages must be at most 2**31 (page ids are int32 in the step "
                             f"plan), got {nb}")
        if budget > I32_MAX:
            raise ValueError(f"max_num_batched_tokens must be at most 2**31-1 (token offsets "
                             f"are int32 in the step plan), got {budget}")
        lp, pt = _u32(logical_pages, "logical_pages"), _u32(page_tokens, "page_tokens")
        seqs = _u32(max_num_seqs, "max_num_seqs")
        if not 1 <= seqs <= 65536:
            raise ValueError(f"max_num_seqs must be in [1, 65536], got {seqs}")
        if lp * pt > I32_MAX:
            raise ValueError(f"logical_pages x page_tokens must be at most 2**31-1 (positions "
                             f"are int32 in the step plan), got {lp} x {pt}")
        if lp * seqs > I32_MAX:
            raise ValueError("max_num_seqs x logical_pages must be at most 2**31-1 (the "
                             "paged-KV offsets are int32 in the step plan)")
        # one slot per running request: the facade twin's max_requests is max_num_seqs
        self.facade = _Facade(seqs, num_pages, page_tokens, logical_pages,
                              prefix_caching=prefix_caching, cache_key=cache_key,
                              max_namespaces=max_namespaces, event_capacity=event_capacity)
        f = self.facade
        self.page_tokens = f.page_tokens
        self.budget = _u32(max_num_batched_tokens, "max_num_batched_tokens")
        if self.budget == 0:
            raise ValueError("max_num_batched_tokens must be at least 1")
        self.max_num_seqs = seqs
        self.max_queued = 4 * seqs if max_queued is None else _u32(max_queued, "max_queued")
        if self.max_queued < self.max_num_seqs:
            raise ValueError(f"max_queued must be at least max_num_seqs={self.max_num_seqs}, "
                             f"got {self.max_queued}")
        self.chunk = None if max_prefill_chunk is None else _u32(max_prefill_chunk,
                                                                 "max_prefill_chunk")
        if self.chunk == 0:
            raise ValueError("max_prefill_chunk must be at least 1 (or None)")
        self.vocab_size = None if vocab_size is None else _u32(vocab_size, "vocab_size")
        if self.vocab_size == 0:
            raise ValueError("vocab_size must be at least 1 (or None)")
        self.max_tokens = f.logical_pages * self.page_tokens
        # request entries and the waiting queue
        self._reqs: Dict[int, _Req] = {}
        self._waiting: List[_Req] = []     # sorted by (priority, arrival)
        self._arrivals = itertools.count()
        # the running set and its block-table rows
        self._running: List[_Req] = []     # admission order
        self._admissions = itertools.count()
        self._rows_free = list(range(self.max_num_seqs))   # lowest first
        self._block_table = np.full((self.max_num_seqs, f.logical_pages), -1, dtype=np.int32)
        self._row_len = [0] * self.max_num_seqs
        self._dirty: Set[int] = set()
        # groups: by group id (the parent's id) and by member id; the child ids handed out that
        # are no requests yet; the live beams parked with their candidates (they hold no slot,
        # row or page, and are out of the queues until their group selects)
        self._groups: Dict[int, Group] = {}
        self._group_of: Dict[int, Group] = {}
        self._reserved: Set[int] = set()
        self._child_ids = itertools.count(CHILD_BASE)
        # ids the running update() returns as finished: still taken until it returns, so a
        # child it makes never takes an id the same call reports finished
        self._finishing: Set[int] = set()
        self._parked: Dict[int, _Req] = {}
        self.forks = 0
        self.fork_fallbacks = 0
        self.parked = 0
        # the plan and what the next plan reports
        self._finished_since: List[int] = []
        self._forked_since: List[Tuple[int, int]] = []   # (child, parent) since the last plan
        self._plan: Optional[StepPlan] = None
        self._aborted_in_plan: Set[int] = set()
        self._deferred_rows: List[int] = []   # rows of requests aborted in the pending plan
        # ...and their facade requests, in abort order: the pages stay held until the plan is
        # retired (a kernel may be executing it)
        self._deferred_finish: List[int] = []
        # copy-on-write copies owed (docs/DESIGN.md, "Copies owed"): made by a reservation and
        # in no applied plan yet, in the order made: [source, destination, the id of the
        # request whose page is the destination, whether the source carries a hold]
        self._owed: List[List[Any]] = []
        self._busy = False     # run() holds the scheduler: mutating calls get BusyError

    def _enter(self) -> None:
        # the core's ownership check: after the arguments are resolved, before any state is read
        if self._busy:
            raise BusyError(None, "the scheduler is running run()")

    # -- reads -------------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def free_pages(self) -> int:
        return self.facade.free_pages

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running or self._parked)

    def requests(self) -> List[int]:
        """Ids of the queued, running and parked requests, in the order they became requests
        (the core lists them by (arrival, id): a group's members share their parent's
        arrival)."""
        return list(self._reqs)

    def request_tokens(self, request_id) -> np.ndarray:
        """Prompt plus generated tokens of a queued, running or parked request."""
        r = self._reqs.get(_u64(request_id, "request_id"))
        if r is None:
            raise StepError.UnknownRequest(None, f"request {request_id}")
        return np.array(r.tokens, dtype=np.uint32)

    def request_pages(self, request_id) -> np.ndarray:
        """The pages a queued, running or parked request holds, in logical order (empty while
        it waits or is parked)."""
        r = self._reqs.get(_u64(request_id, "request_id"))
        if r is None:
            raise StepError.UnknownRequest(None, f"request {request_id}")
        if not any(q is r for q in self._running):
            return np.zeros(0, dtype=np.uint32)
        return self.facade.block_table(r.request_id)

    def group_members(self, request_id) -> List[int]:
        """The member ids of a queued or running ``n`` group (what the sampler keys on), or of
        the live beams of a beam group."""
        g = self._groups.get(_u64(request_id, "request_id"))
        if g is None:
            raise StepError.UnknownRequest(None, f"no group {request_id}")
        return list(g.members)

    def stats(self) -> Dict[str, int]:
        """``qualia.StepScheduler.stats()``: running requests' slots, pages free, used, cached
        and reclaimable, pages copied (copy-on-write) and allocated so far."""
        st = self.facade.stats()
        return {
            "active": st["active"],
            "max_num_seqs": self.max_num_seqs,
            "num_pages": st["num_pages"],
            "free_pages": st["free_pages"],
            "used_pages": st["used_pages"],
            "cached_pages": st["cached_pages"],
            "reclaimable_pages": st["reclaimable_pages"],
            "pages_copied": st["pages_copied"],
            "pages_allocated": st["pages_allocated"],
        }

    def cache_stats(self) -> CacheStats:
        return self.facade.cache_stats()

    def drain_events(self, out=None):
        return self.facade.drain_events(out)

    def clear_cache(self) -> int:
        return self.facade.clear_cache()

    def _debug_identity_mask(self, mask, parent_mask=M64) -> None:
        self.facade._debug_identity_mask(mask, parent_mask)

    def _debug_namespaces(self):
        return self.facade._debug_namespaces()

    # -- the waiting queue -------------------------------------------------------------------------
    def _enqueue(self, r: _Req) -> None:
        key = (r.priority, r.arrival)
        i = 0
        while i < len(self._waiting) and (self._waiting[i].priority,
                                          self._waiting[i].arrival) < key:
            i += 1
        self._waiting.insert(i, r)

    def _unqueue(self, r: _Req) -> None:
        """A request that is not running leaves the queue (or, a parked beam, the parked
        set)."""
        if self._parked.pop(r.request_id, None) is None:
            self._waiting.remove(r)

    # -- requests in -------------------------------------------------------------------------------
    def add_request(self, request_id, prompt_tokens, *, max_new_tokens, n=1, beam_width=None,
                    namespace=b"", priority=0, eos_token_id=None, stop_token_ids=(),
                    ignore_eos=False) -> None:
        rid = _u64(request_id, "request_id")
        n = group_size(n, "n", self.max_num_seqs)
        if beam_width is not None:
            beam_width = group_size(beam_width, "beam_width", self.max_num_seqs)
            if n != 1:
                raise ValueError("beam search returns beam_width hypotheses: leave n at 1")
            if self.vocab_size is not None and beam_width > self.vocab_size:
                # a beam row's w candidates are distinct tokens of the vocabulary
                raise ValueError(f"beam_width must be at most vocab_size={self.vocab_size}, "
                                 f"got {beam_width}")
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
        max_new = _u32(max_new_tokens, "max_new_tokens")
        if max_new == 0:
            raise ValueError("max_new_tokens must be at least 1")
        prio = _i32(priority, "priority")
        eos = None if eos_token_id is None else _u32(eos_token_id, "eos_token_id")
        if isinstance(stop_token_ids, (str, bytes, bytearray, memoryview)):
            raise TypeError("stop_token_ids must be a sequence of token ids")
        stop = [_u32(t, "stop token id") for t in stop_token_ids]
        if len(stop) > MAX_STOP_TOKENS:
            raise ValueError(f"at most {MAX_STOP_TOKENS} stop token ids, got {len(stop)}")
        limit = token_limit(self.vocab_size)
        # an end or stop id is a token id a step can sample: another never matches
        if eos is not None and eos > limit:
            raise ValueError(f"eos_token_id {eos} is outside [0, {limit}]: no sampled token can "
                             f"match it")
        for x in stop:
            if x > limit:
                raise ValueError(f"stop token id {x} is outside [0, {limit}]: no sampled token "
                                 f"can match it")
        ignore = bool(ignore_eos)
        ns = _namespace_bytes(namespace)
        if len(ns) > NS_MAX_BYTES:
            raise ValueError(f"a namespace is at most {NS_MAX_BYTES} bytes, got {len(ns)}")
        tokens = self.facade._load_tokens(prompt_tokens)
        if not tokens:
            raise ValueError("the prompt must have at least one token")
        self._enter()
        if self._taken(rid):
            raise StepError.DuplicateRequest(None, f"request {rid}")
        total = len(tokens) + max_new
        if total > self.max_tokens:
            raise StepError.NeverFits(None, f"{len(tokens)} prompt + {max_new} new tokens pass "
                                            f"the table's {self.max_tokens} tokens")
        pages = -(-(total - 1) // self.page_tokens)
        if pages > self.facade.num_pages:
            raise StepError.NeverFits(None, f"{pages} pages needed, the pool has "
                                            f"{self.facade.num_pages}")
        # a group takes its width of queue entries at once
        entries = n if beam_width is None else beam_width
        if self._entries_used() + entries > self.max_queued:
            raise StepError.QueueFull(None, f"{self.max_queued} requests queued")
        r = _Req(rid, tokens, len(tokens), max_new, ns, prio, next(self._arrivals), eos,
                 set(stop), ignore)
        self._reqs[rid] = r
        self._enqueue(r)
        g: Optional[Group] = None
        if beam_width is not None:
            g = BeamGroup(rid, beam_width, [rid])
        elif n > 1:
            g = NGroup(rid, n, [rid])
            for _ in range(1, n):
                cid = self._new_child_id()
                self._reserved.add(cid)
                g.members.append(cid)
        if g is not None:
            self._groups[rid] = g
            self._group_of[rid] = g

    def _taken(self, rid: int) -> bool:
        """Whether ``rid`` names a request the scheduler holds (add_request refuses it): every
        member id of a live group is taken (reserved, running, waiting or stopped) until the
        group's result is returned."""
        return (rid in self._reqs or rid in self._reserved or rid in self._group_of
                or rid in self._groups or rid in self._finishing)

    def _entries_used(self) -> int:
        """Queue entries in use (the core's token-arena entries).  A group (n or beam) holds its
        width from add_request until its result is returned: an n group's reserved children and
        stopped members (the core keeps their outputs there), a beam group's live beams and
        hypotheses (the core keeps each hypothesis's tokens in one of them)."""
        return (sum(1 for rid in self._reqs if rid not in self._group_of)
                + sum(g.width for g in self._groups.values()))

    def _new_child_id(self) -> int:
        # a child skips taken ids, the ids of requests aborted in the pending plan (their pages
        # stay with them, under their ids, until the plan is retired) and the ids the next plan
        # reports finished (a backend applies a plan's forks before its finished ids)
        while True:
            cid = next(self._child_ids)
            if (not self._taken(cid) and cid not in self._aborted_in_plan
                    and cid not in self._finished_since):
                return cid

    # -- the running set and its rows ------------------------------------------------------------
    def _release_row(self, r: _Req) -> None:
        if r.row < 0:
            return
        self._clear_row(r.row)
        r.row = -1

    def _clear_row(self, row: int) -> None:
        n = self._row_len[row]
        if n:
            self._block_table[row, :n] = -1
            self._row_len[row] = 0
            self._dirty.add(row)
        self._rows_free.append(row)
        self._rows_free.sort()

    def _clear_deferred_rows(self) -> None:
        # the plan is retired: the rows and the pages of the requests aborted while it was
        # pending are free again (pages in abort order)
        for row in self._deferred_rows:
            self._clear_row(row)
        self._deferred_rows = []
        for rid in self._deferred_finish:
            self._finish_pages(rid)
        self._deferred_finish = []

    def _stop_running(self, r: _Req) -> None:
        # give the pages back (full pages stay cached) and the row; leave the running list
        self._finish_pages(r.request_id)
        self._release_row(r)
        self._running.remove(r)
        r.running = False
        r.num_computed = 0

    def _has_cand(self, r: _Req) -> bool:
        # a live beam whose candidates wait for its group's selection
        g = self._group_of.get(r.request_id)
        return isinstance(g, BeamGroup) and r.request_id in g.cand

    def _pick_victim(self, pool: List[_Req]) -> _Req:
        """The request a reservation that cannot be met preempts: of the running requests not
        yet scheduled in this step and the current one, a computed beam waiting for its group
        first (it keeps its candidates), then the largest priority value, ties going to the
        most recently admitted."""
        ready = [q for q in pool if self._has_cand(q)]
        return max(ready or pool, key=lambda q: (q.priority, q.admitted))

    def _preempt(self, r: _Req) -> None:
        # its pages back (full pages stay cached), its computed tokens forgotten: it waits
        # again; a computed beam is parked with its candidates instead
        if self._has_cand(r):
            park(self, r)
            return
        self._stop_running(r)
        self._enqueue(r)

    # -- copies owed (docs/DESIGN.md, "Copies owed") -----------------------------------------------
    def _owe(self, r: _Req, copies: np.ndarray) -> None:
        # a reservation's copies: owed until a plan listing them is applied
        for src, dst in copies.tolist():
            self._owed.append([src, dst, r.request_id, False])

    def _hold(self, page: int) -> None:
        self.facade.pool.retain(page)
        self.facade._on_retain(page)

    def _unhold(self, page: int) -> None:
        self.facade.pool.release(page)
        self.facade._on_release(page)

    def _finish_pages(self, rid: int) -> None:
        # the request lets its pages go: the copies owed into them are moot (dropped, their
        # holds released), then each copy still owed whose source is one of its pages holds
        # that page, so the source outlives its last holder until the copy is applied
        if self._owed:
            keep = []
            for c in self._owed:
                if c[2] == rid:
                    if c[3]:
                        self._unhold(c[0])
                else:
                    keep.append(c)
            self._owed = keep
            f = self.facade
            pages = f._slots[f._find(rid)].blocks.entries()
            for c in self._owed:
                if not c[3] and c[0] in pages:
                    self._hold(c[0])
                    c[3] = True
        self.facade.finish(rid)

    def _owed_applied(self) -> None:
        # update(): the plan listed every copy owed and was applied: the holds go, in order
        for c in self._owed:
            if c[3]:
                self._unhold(c[0])
        self._owed = []

    # -- requests out ------------------------------------------------------------------------------
    def abort(self, request_id) -> None:
        """Abort a request in any state; a group's id aborts every member (a member alone is
        refused)."""
        rid = _u64(request_id, "request_id")
        self._enter()       # the core owns the scheduler before it looks the id up
        g = self._groups.get(rid)
        if g is None:
            if rid in self._group_of:
                raise StepError.UnknownRequest(None, f"request {rid} is a group member: abort "
                                                     f"the group ({self._group_of[rid].parent})")
            r = self._reqs.get(rid)
            if r is None:
                raise StepError.UnknownRequest(None, f"request {rid}")
            self._abort(r)
            return
        for m in [m for m in g.members if m in self._reqs]:
            self._abort(self._reqs[m])
        self._drop_group(g)

    def _abort(self, r: _Req) -> None:
        rid = r.request_id
        if r.running:
            if self._plan is not None and any(c is r for c, _ in self._plan._chunks):
                # the pending plan may be executing: the request keeps its pages and its
                # block-table row keeps them, until update() / discard_plan() retires the plan
                self._aborted_in_plan.add(rid)
                self._deferred_rows.append(r.row)
                self._deferred_finish.append(rid)
                r.row = -1
                self._running.remove(r)
                r.running = False
                r.num_computed = 0
            else:
                self._stop_running(r)
        else:
            self._unqueue(r)
        del self._reqs[rid]
        self._finished_since.append(rid)

    def _drop_group(self, g: Group) -> None:
        for m in [m for m, x in self._group_of.items() if x is g]:
            del self._group_of[m]
        self._reserved.difference_update(g.members)
        self._groups.pop(g.parent, None)

    def _finish_member(self, r: _Req) -> None:
        # a request (or group member) that stopped leaves the running set or the queues
        if r.running:
            self._stop_running(r)
        else:
            self._unqueue(r)
        del self._reqs[r.request_id]
        self._finished_since.append(r.request_id)

    # -- one step out ------------------------------------------------------------------------------
    def _reserve(self, r: _Req, n: int):
        try:
            copies = self.facade.reserve(r.request_id, n)
        except SchedulerError as err:
            if isinstance(err.cause, TableError.Exhausted):
                return None
            raise
        self._owe(r, copies)
        return copies

    def schedule(self) -> StepPlan:
        self._enter()
        return self._schedule()

    def _schedule(self) -> StepPlan:
        if self._plan is not None:
            raise StepError.PlanPending(None, "update() the previous plan first")
        pt = self.page_tokens
        left = self.budget
        chunks = []            # (req, start, n, is_decode)
        preempted: List[int] = []
        new: List[int] = []
        cached = 0
        scheduled: Set[int] = set()
        decodes = [r for r in self._running if len(r.tokens) - r.num_computed == 1]
        prefills = [r for r in self._running if len(r.tokens) - r.num_computed > 1]
        for r in decodes + prefills:
            if left == 0:
                break
            if not r.running:          # preempted earlier in this step
                continue
            remaining = len(r.tokens) - r.num_computed
            n = min(remaining, left)
            if remaining > 1 and self.chunk is not None:
                n = min(n, self.chunk)
            while True:
                if self._reserve(r, n) is not None:
                    break
                victim = self._pick_victim(
                    [q for q in self._running if q.request_id not in scheduled])
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is r:
                    break
            if not r.running:
                continue
            scheduled.add(r.request_id)
            # a decode feeds back a generated token: the last token of a prompt is prefilled
            chunks.append((r, r.num_computed, n,
                           remaining == 1 and r.num_computed >= r.prompt_len))
            if r.unseen:
                # admitted by a discarded plan: named until a plan with it is applied
                new.append(r.request_id)
            left -= n
        if not preempted:
            while self._waiting and left > 0 and len(self._running) < self.max_num_seqs:
                r = self._waiting[0]
                hit = self.facade.cached_prefix(r.tokens, r.namespace)
                n = min(len(r.tokens) - hit.tokens, left)
                if len(r.tokens) - hit.tokens > 1 and self.chunk is not None:
                    n = min(n, self.chunk)
                need = (hit.tokens + n - 1) // pt + 1 - hit.pages
                if need > self.facade.free_pages - hit.reclaimable:
                    break
                try:
                    adm = self.facade.admit(r.request_id, r.tokens, r.namespace)
                except PrefixCacheError:
                    # every namespace id is held by live requests or cached pages: wait for
                    # running requests to free one; with none running, nothing ever would
                    # (and nothing has changed in this step), so say so
                    if not self._running:
                        raise
                    break
                assert adm.prefix_tokens == hit.tokens
                self._owe(r, self.facade.reserve(r.request_id, n))
                self._waiting.pop(0)
                r.running = True
                r.num_computed = hit.tokens
                r.admitted = next(self._admissions)
                r.row = self._rows_free.pop(0)
                self._running.append(r)
                r.unseen = True
                new.append(r.request_id)
                cached += hit.tokens
                chunks.append((r, r.num_computed, n, False))
                left -= n
        return self._lower(chunks, new, preempted, cached)

    def _lower(self, chunks, new, preempted, cached) -> StepPlan:
        pt = self.page_tokens
        f = self.facade
        rids, qsl, seq_lens, rows = [], [0], [], []
        ids: List[int] = []
        pos: List[int] = []
        slots: List[int] = []
        logits: List[int] = []
        sampled: List[int] = []
        topk = 0
        indptr, indices, last_len = [0], [], []
        # every copy owed, in the order made: a discarded plan's (and a failed schedule's) first
        copies = [(c[0], c[1]) for c in self._owed]
        n_decode = 0
        for r, start, n, is_decode in chunks:
            table = f._slots[f._find(r.request_id)].blocks.entries()
            # the request's row: write what differs
            row = self._block_table[r.row]
            for i, page in enumerate(table):
                if row[i] != page:
                    row[i] = page
                    self._dirty.add(r.row)
            self._row_len[r.row] = len(table)
            rids.append(r.request_id)
            rows.append(r.row)
            end = start + n
            seq_lens.append(end)
            for p in range(start, end):
                ids.append(r.tokens[p])
                pos.append(p)
                slots.append(table[p // pt] * pt + p % pt)
            qsl.append(qsl[-1] + n)
            if end == len(r.tokens):
                # the chunk reaches the request's last token: its row is sampled -- once per
                # member by an n group not yet forked, with candidates by a beam
                g = self._group_of.get(r.request_id)
                members = g.members if isinstance(g, NGroup) and not g.forked else \
                    [r.request_id]
                logits.extend([qsl[-1] - 1] * len(members))
                sampled.extend(members)
                if isinstance(g, BeamGroup):
                    topk = max(topk, g.width)
            npages = -(-end // pt)
            indices.extend(table[:npages])
            indptr.append(indptr[-1] + npages)
            last_len.append(end - (npages - 1) * pt)
            if is_decode:
                n_decode += n
        plan = StepPlan(
            request_ids=np.array(rids, dtype=np.uint64),
            query_start_loc=np.array(qsl, dtype=np.int32),
            seq_lens=np.array(seq_lens, dtype=np.int32),
            input_ids=np.array(ids, dtype=np.uint32),
            positions=np.array(pos, dtype=np.int32),
            slot_mapping=np.array(slots, dtype=np.int64),
            logits_indices=np.array(logits, dtype=np.int32),
            sampled_request_ids=np.array(sampled, dtype=np.uint64),
            block_table=self._block_table.view(),
            block_table_rows=np.array(rows, dtype=np.int32),
            changed_rows=np.array(sorted(self._dirty), dtype=np.int32),
            kv_indptr=np.array(indptr, dtype=np.int32),
            kv_indices=np.array(indices, dtype=np.int32),
            kv_last_page_len=np.array(last_len, dtype=np.int32),
            copies=np.array([tuple(c) for c in copies], dtype=COPY_OP),
            new_request_ids=np.array(new, dtype=np.uint64),
            preempted_request_ids=np.array(preempted, dtype=np.uint64),
            finished_request_ids=np.array(self._finished_since, dtype=np.uint64),
            num_prefill_tokens=len(ids) - n_decode,
            num_decode_tokens=n_decode,
            num_cached_tokens=cached,
            page_tokens=pt,
            fork_child_ids=np.array([c for c, _ in self._forked_since], dtype=np.uint64),
            fork_parent_ids=np.array([p for _, p in self._forked_since], dtype=np.uint64),
            num_topk=topk,
            _chunks=[(r, n) for r, _, n, _ in chunks],
        )
        for value in vars(plan).values():
            if isinstance(value, np.ndarray):
                value.flags.writeable = False
        self._dirty = set()
        self._finished_since = []
        self._forked_since = []
        self._aborted_in_plan = set()
        self._plan = plan
        return plan

    # -- tokens back -------------------------------------------------------------------------------
    @staticmethod
    def _resolve_sampled(sampled_token_ids) -> List[int]:
        # conversion only (user code -- __index__, iterators -- runs here): no state is read
        if isinstance(sampled_token_ids, np.ndarray):
            arr = sampled_token_ids
            if arr.ndim != 1:
                raise ValueError(f"sampled_token_ids must be 1-D, got {arr.ndim} dimensions")
            if arr.dtype.kind not in "iu":
                raise TypeError(f"sampled_token_ids must be integers, got dtype {arr.dtype}")
            values = arr.tolist()
        else:
            if isinstance(sampled_token_ids, (str, bytes, bytearray, memoryview)):
                raise TypeError("sampled_token_ids must be a sequence of token ids")
            values = [_u32(t, "sampled token id") for t in sampled_token_ids]
        return values

    def _check_sampled(self, values: List[int]) -> List[int]:
        # against the plan pending now (after the conversion ran)
        if self._plan is None:
            raise StepError.NoPlan(None, "schedule() first")
        m = len(self._plan.logits_indices)
        if len(values) != m:
            raise ValueError(f"the plan samples {m} rows, got {len(values)} token ids")
        limit = token_limit(self.vocab_size)
        for v in values:
            if not 0 <= v <= limit:
                raise ValueError(f"sampled token id {v} is outside [0, {limit}]")
        return values

    def update(self, sampled_token_ids, topk_ids=None, topk_logprobs=None) -> List[Any]:
        """Apply the pending plan: one sampled token id per row; a plan with beam rows
        (``num_topk > 0``) also takes each row's ``num_topk`` best ids and their
        log-probabilities (``[m, num_topk]`` arrays).  Returns the requests
        (``FinishedRequest``) and groups (``FinishedGroup``) that finished, in that order."""
        if self._plan is None:
            raise StepError.NoPlan(None, "schedule() first")
        values = self._resolve_sampled(sampled_token_ids)    # user code runs here only
        topk = resolve_topk(topk_ids, topk_logprobs)         # (and here)
        self._enter()
        return self._update(values, *topk)

    def _update(self, values, topk_ids, topk_logprobs, err=None) -> List[Any]:
        # checked against the plan pending now, then applied
        values = self._check_sampled(values)
        plan = self._plan
        assert plan is not None
        tids, tlps = check_topk(self, plan, topk_ids, topk_logprobs, err)
        f = self.facade
        self._owed_applied()      # the plan listed every copy owed, and it is applied
        finished: List[Any] = []
        selecting: List[BeamGroup] = []
        for r, n, first, end in chunk_rows(plan):
            if r.request_id in self._aborted_in_plan:
                continue
            r.unseen = False
            f.advance(r.request_id, n)
            r.num_computed += n
            if end == first:
                continue
            g = self._group_of.get(r.request_id)
            if isinstance(g, BeamGroup):
                # a beam row: its candidates wait for the group's selection
                g.cand[r.request_id] = (tids[first, :g.width].tolist(),
                                        tlps[first, :g.width].tolist())
                if not any(x is g for x in selecting):
                    selecting.append(g)
            elif isinstance(g, NGroup) and not g.forked:
                fork_n(self, g, r, values[first:end], finished)
            else:
                self._take(r, values[first], finished)
        # beam groups select in the order their first row appears in the plan
        for g in selecting:
            select(self, g, finished)
        if len(plan.input_ids) == 0:
            park_blocked(self)
        self._plan = None
        self._aborted_in_plan = set()
        self._clear_deferred_rows()
        self._finishing.clear()
        return finished

    def _note(self, r: _Req, tok: int) -> None:
        # the request's next token (the cache's token stream too, when it runs)
        f = self.facade
        if r.running:
            f._note_token(f._find(r.request_id), len(r.tokens), tok)
        r.tokens.append(tok)
        if self._parked.pop(r.request_id, None) is not None:
            self._enqueue(r)        # a parked beam continues: it has a token to compute

    def _take(self, r: _Req, tok: int, finished: List[Any]) -> None:
        # one sampled token for a plain request or a forked member of an n group: noted, then
        # the stop rule; the last member of an n group to stop finishes the group
        self._note(r, tok)
        reason = r.finish_reason(tok, r.num_outputs)
        if reason is None:
            return
        out = r.tokens[r.prompt_len:]
        self._finish_member(r)
        g = self._group_of.get(r.request_id)
        if not isinstance(g, NGroup):
            self._finishing.add(r.request_id)
            finished.append(FinishedRequest(r.request_id, np.array(out, dtype=np.uint32),
                                            reason))
            return
        g.results[r.request_id] = (out, reason)
        if len(g.results) == len(g.members):
            self._finishing.update(g.members)
            finished.append(FinishedGroup(
                g.parent, [np.array(g.results[m][0], dtype=np.uint32) for m in g.members],
                [g.results[m][1] for m in g.members], None, list(g.members)))
            self._drop_group(g)

    # -- the loop ----------------------------------------------------------------------------------
    def run(self, backend, max_steps=None, *, stats_rows=RUN_STATS_ROWS) -> RunResult:
        """schedule, execute, update until idle or ``max_steps`` steps; ``RunResult(stats,
        finished, steps, totals)`` keeps the rows of the last ``stats_rows`` steps and sums
        the ``STEP_TOTALS`` fields over all of them.  ``backend.execute_step(plan)`` returns
        the sampled ids, or ``(sampled, topk_ids, topk_logprobs)`` when the plan has beam rows;
        ``finished`` holds ``FinishedRequest`` and ``FinishedGroup`` records in the order they
        finished.  The scheduler is held for the whole call (a backend calling a mutating
        method gets BusyError).  If the backend fails, its step is discarded and the error
        propagates with ``finished``: the requests the earlier steps of this call finished
        (they are no longer queued)."""
        limit = None if max_steps is None else _u32(max_steps, "max_steps")
        ring_rows = _u32(stats_rows, "stats_rows")
        execute = backend_attr(backend, "execute_step")
        if not callable(execute):
            raise TypeError(f"backend must be a C step backend (__qualia_step_backend__ capsule) "
                            f"or have an execute_step(plan) method, not {type(backend).__name__}")
        self._enter()
        stats: Deque[tuple] = collections.deque(maxlen=ring_rows)
        totals = [0] * len(STEP_TOTALS)
        steps = 0
        finished: List[Any] = []
        self._busy = True
        try:
            while self.has_unfinished() and (limit is None or steps < limit):
                plan = self._schedule()
                done = self._run_step(execute, plan)
                finished.extend(done)
                row = (plan.num_seqs, plan.num_tokens, plan.num_prefill_tokens,
                       plan.num_decode_tokens, len(plan.logits_indices),
                       len(plan.new_request_ids), len(plan.preempted_request_ids),
                       plan.num_cached_tokens, len(done), self.num_waiting,
                       self.num_running, self.facade.free_pages)
                if ring_rows:
                    stats.append(row)
                for k in range(len(totals)):
                    totals[k] += row[k]
                steps += 1
            return RunResult(np.array(list(stats), dtype=STEP_STATS), finished, steps,
                             dict(zip(STEP_TOTALS, totals)))
        except BaseException as err:
            try:
                err.finished = finished     # type: ignore[attr-defined]
            except Exception:
                pass
            raise
        finally:
            self._busy = False

    def _run_step(self, execute, plan: StepPlan) -> List[Any]:
        # run()'s one step after schedule: execute the plan and apply it; a failure before
        # anything changed discards it
        try:
            out = execute(plan)
            ids, tk, tl = out if _is_topk_triple(out) else (out, None, None)
            return self._update(self._resolve_sampled(ids), *resolve_topk(tk, tl))
        except BaseException:
            if self._plan is plan:
                self._discard()
            raise

    def discard_plan(self) -> None:
        """Drop the pending plan after its execution failed: the scheduled tokens stay
        uncomputed and are scheduled again by the next step; its copies stay owed (the next
        plan lists them first)."""
        self._enter()
        self._discard()

    def _discard(self) -> None:
        plan = self._plan
        if plan is not None:
            # reported again by the next plan: the failed execution may not have applied them
            self._dirty |= set(plan.changed_rows.tolist())
            self._finished_since = plan.finished_request_ids.tolist() + self._finished_since
            self._forked_since = (list(zip(plan.fork_child_ids.tolist(),
                                           plan.fork_parent_ids.tolist()))
                                  + self._forked_since)
        self._plan = None
        self._aborted_in_plan = set()
        self._clear_deferred_rows()
