"""``qualia.vllm.Scheduler``: vLLM's scheduler interface over qualia's compiled engine step.

qualia's core decides every step: which waiting requests are admitted and in what order, the token
budget and the prefill chunks, preemption and resumption, the KV pages (from qualia's pool), the
prefix-cache hits and the release of pages.  This class translates: a vLLM ``Request`` becomes a
core request (an integer id, its tokens, its limits), a core plan becomes vLLM's
``SchedulerOutput``, the model runner's sampled tokens go back through the core's ``update``.

It subclasses vLLM's ``Scheduler`` for the attributes and helpers vLLM's engine reads (the
connectors it refuses, the encoder cache manager it never fills, the output structs), and
overrides every method that decides or allocates.  vLLM's own ``schedule`` and its KV cache
manager's ``allocate_slots`` / ``get_computed_blocks`` never run.

Block ids: qualia's page ``p`` is vLLM block ``p + 1``; block 0 is vLLM's null block, which no
request is given.  One KV-cache group only.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Set, Tuple

import numpy as np
from vllm.multimodal import MULTIMODAL_REGISTRY
from vllm.v1.core.sched.interface import PauseState
from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler as _VllmScheduler
from vllm.v1.engine import EngineCoreEventType, EngineCoreOutput, EngineCoreOutputs
from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec
from vllm.v1.metrics.stats import SchedulerStats
from vllm.v1.request import Request, RequestStatus

# The one place that names the core class: the engine step's methods (add_request, schedule,
# update, abort, clear_cache, ...) are reached through _Core only.
from qualia import StepScheduler as _Core

#: Stop token ids the core holds per request; a request with more has the rest checked here.
_CORE_MAX_STOPS = 16

#: Runs an iterator to its end (map() over a C function, without a Python loop).
_consume: Callable[[Iterable[Any]], None] = deque(maxlen=0).extend
_chain = itertools.chain.from_iterable


class UnsupportedByQualia(ValueError):
    """A vLLM feature that ``qualia.vllm.Scheduler`` does not implement (docs/vllm.md)."""


def _refuse(what: str) -> UnsupportedByQualia:
    return UnsupportedByQualia(
        f"qualia.vllm.Scheduler does not support {what}; run vLLM with its own scheduler "
        f"for this (see qualia's docs/vllm.md, 'Support matrix')"
    )


def check_config(vllm_config: Any, kv_cache_config: Any, block_size: int) -> None:
    """Raise ``UnsupportedByQualia`` for an engine configuration the class cannot serve."""
    sc = vllm_config.scheduler_config
    mc = vllm_config.model_config
    if vllm_config.speculative_config is not None:
        raise _refuse("speculative decoding")
    if vllm_config.kv_transfer_config is not None:
        raise _refuse("KV connectors (kv_transfer_config)")
    if vllm_config.ec_transfer_config is not None:
        raise _refuse("encoder-cache connectors (ec_transfer_config)")
    if vllm_config.lora_config is not None:
        raise _refuse("LoRA adapters")
    aux = getattr(vllm_config, "aux_output_config", None)
    if aux is not None and aux.enabled:
        raise _refuse("execution auxiliary outputs (routed experts: aux_output_config)")
    if mc is not None and mc.runner_type == "pooling":
        raise _refuse("pooling models")
    if mc is not None and mc.is_encoder_decoder:
        raise _refuse("encoder-decoder models")
    if getattr(mc, "is_diffusion", False):
        raise _refuse("diffusion models")
    if float(getattr(sc, "watermark", 0.0) or 0.0) > 0.0:
        raise _refuse(f"a KV-cache watermark (watermark={sc.watermark}; the core's admissions "
                      "keep no blocks in reserve: pass watermark=0, the default)")
    if sc.async_scheduling:
        raise _refuse("async scheduling (pass async_scheduling=False, "
                      "--no-async-scheduling)")
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise _refuse("pipeline parallelism (more than one batch in flight)")
    if vllm_config.parallel_config.decode_context_parallel_size > 1:
        raise _refuse("decode context parallelism")
    if vllm_config.parallel_config.prefill_context_parallel_size > 1:
        raise _refuse("prefill context parallelism")
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise _refuse(f"{len(groups)} KV-cache groups (hybrid or sliding-window models); "
                      "exactly one full-attention group is supported")
    spec = groups[0].kv_cache_spec
    if type(spec) not in (FullAttentionSpec, MLAAttentionSpec) or getattr(
            spec, "sliding_window", None) is not None or getattr(
            spec, "attention_chunk_size", None) is not None:
        raise _refuse(f"KV-cache spec {type(spec).__name__} (sliding-window, chunked-local, "
                      "Mamba and other non-full-attention layers)")
    if spec.block_size != block_size:
        raise _refuse(f"a scheduler block size ({block_size}) other than the KV-cache "
                      f"group's ({spec.block_size})")


class _Waiting:
    """The waiting requests (``Scheduler.waiting``): those the core holds in its queue, then those
    the adapter holds back while the core's queue is full, each part in arrival order."""

    __slots__ = ("_reqs",)

    def __init__(self) -> None:
        self._reqs: Dict[str, Request] = {}

    def __len__(self) -> int:
        return len(self._reqs)

    def __bool__(self) -> bool:
        return bool(self._reqs)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._reqs.values()))

    def __contains__(self, request: object) -> bool:
        rid = getattr(request, "request_id", None)
        return rid is not None and self._reqs.get(rid) is request

    def __getitem__(self, i: int) -> Request:
        return list(self._reqs.values())[i]

    def add_request(self, request: Request) -> None:
        self._reqs[request.request_id] = request

    def prepend_request(self, request: Request) -> None:
        self.prepend_requests([request])

    def prepend_requests(self, requests: List[Request]) -> None:
        """Put ``requests`` at the head, in their order."""
        rest = self._reqs
        self._reqs = {r.request_id: r for r in requests}
        for rid, r in rest.items():
            if rid not in self._reqs:
                self._reqs[rid] = r

    def remove_request(self, request: Request) -> None:
        self._reqs.pop(request.request_id, None)

    def remove_requests(self, requests: Iterable[Request]) -> None:
        for r in requests:
            self._reqs.pop(r.request_id, None)

    def ids(self) -> Iterable[str]:
        return self._reqs.keys()

    def restore_order(self, order: List[str], back: Dict[str, Request]) -> None:
        """Put the requests of ``back`` in again: the ids of ``order`` in that order (those still
        waiting, and those of ``back``), then every other waiting request in its order."""
        rest = self._reqs
        reqs: Dict[str, Request] = {}
        for rid in order:
            r = back.get(rid) or rest.get(rid)
            if r is not None:
                reqs[rid] = r
        for rid, r in rest.items():
            if rid not in reqs:
                reqs[rid] = r
        self._reqs = reqs

    def peek_request(self) -> Request:
        if not self._reqs:
            raise IndexError("peek from an empty queue")
        return next(iter(self._reqs.values()))


class _Backlog:
    """The requests waiting in the adapter, in queue order: under ``fcfs`` the order they came,
    except that requests put back at the head come before them; under ``priority`` vLLM's
    order of requests (priority, then arrival time, then id), wherever they came from."""

    __slots__ = ("_heap", "_priority", "_back", "_front")

    def __init__(self, priority: bool) -> None:
        self._heap: List[Tuple[Any, Request]] = []
        self._priority = priority
        self._back = 0
        self._front = 0

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[Request]:
        return iter([r for _, r in sorted(self._heap, key=lambda e: e[0])])

    def _key(self, request: Request, seq: int) -> Any:
        if self._priority:
            return (request.priority, request.arrival_time, request.request_id, seq)
        return seq

    def push_back(self, request: Request) -> None:
        self._back += 1
        heapq.heappush(self._heap, (self._key(request, self._back), request))

    def push_front(self, requests: List[Request]) -> None:
        """Put ``requests`` at the head, in their order (under ``priority``: in their place)."""
        for r in reversed(requests):
            self._front -= 1
            heapq.heappush(self._heap, (self._key(r, self._front), r))

    def peek(self) -> Request:
        return self._heap[0][1]

    def pop(self) -> Request:
        return heapq.heappop(self._heap)[1]

    def remove(self, request: Request) -> None:
        heap = self._heap
        for i, (_, r) in enumerate(heap):
            if r is request:
                heap[i] = heap[-1]
                heap.pop()
                heapq.heapify(heap)
                return
        raise ValueError(f"request {request.request_id!r} is not in the backlog")


class Scheduler(_VllmScheduler):
    """vLLM's scheduler interface, decided by qualia's compiled engine step
    (``qualia.StepScheduler``): admission and its order, the token budget and prefill chunks,
    preemption, KV block ids and prefix hits (docs/vllm.md).  Pass it to vLLM as
    ``scheduler_cls="qualia.vllm.Scheduler"``; vLLM's engine constructs it."""

    # vLLM's attributes this class assigns (declared so that the class type-checks without vLLM)
    running: List[Request]
    finished_req_ids: Set[str]
    reset_preempted_req_ids: Set[str]

    def __init__(
        self,
        vllm_config: Any,
        kv_cache_config: Any,
        structured_output_manager: Any,
        block_size: int,
        hash_block_size: Optional[int] = None,
        mm_registry: Any = MULTIMODAL_REGISTRY,
        include_finished_set: bool = False,
        log_stats: bool = False,
    ) -> None:
        check_config(vllm_config, kv_cache_config, block_size)
        super().__init__(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=structured_output_manager,
            block_size=block_size,
            hash_block_size=hash_block_size,
            mm_registry=mm_registry,
            include_finished_set=include_finished_set,
            log_stats=log_stats,
        )
        sc = self.scheduler_config
        num_blocks = int(kv_cache_config.num_blocks)
        if num_blocks < 2:
            raise ValueError(f"qualia.vllm.Scheduler needs at least 2 KV blocks, got {num_blocks}")
        self._num_pages = num_blocks - 1  # block 0 is vLLM's null block
        logical_pages = -(-int(self.max_model_len) // block_size)
        # admission is capped by max_num_active_seqs (max_num_seqs unless set)
        max_seqs = int(self.max_num_active_reqs)
        entry_bytes = 4 * logical_pages * block_size
        max_queued = max(2 * max_seqs, min(4 * max_seqs, (256 << 20) // entry_bytes))
        threshold = int(sc.long_prefill_token_threshold or 0)
        self._prefix_caching = bool(self.cache_config.enable_prefix_caching)
        self._core = _Core(
            num_pages=self._num_pages,
            page_tokens=block_size,
            logical_pages=logical_pages,
            max_num_seqs=max_seqs,
            prefix_caching="auto" if self._prefix_caching else "off",
            max_num_batched_tokens=int(self.max_num_scheduled_tokens),
            max_queued=max_queued,
            max_prefill_chunk=threshold if threshold > 0 else None,
        )
        self._priority_policy = self.policy.value == "priority"
        # vLLM's queues are replaced: the core holds the queue; `waiting` lists what waits.
        # (the ignore is unused where vLLM is not installed: the base class is then Any)
        self.waiting = _Waiting()  # type: ignore[assignment, unused-ignore]
        # waiting in the adapter: while the core's queue is full, and every waiting request
        # while admissions are held (PAUSED_NEW); in queue order
        self._backlog = _Backlog(self._priority_policy)
        self._backlog_arrivals = False  # (priority) a request came to the backlog since a drain
        self._qid: Dict[str, int] = {}  # vLLM request id -> core id
        self._by_qid: Dict[int, Request] = {}
        self._next_qid = 1
        self._extra_stops: Dict[int, frozenset] = {}  # core id -> stop ids past the core's 16
        self._in_runner: set = set()  # request ids the model runner holds state for
        self._hit_tokens: Dict[str, int] = {}  # request id -> prefix hit at its first admission
        # Per block-table row of the core: the request holding it and what the runner was told.
        self._row_req: List[Optional[Request]] = [None] * max_seqs
        self._row_sent = np.zeros(max_seqs, dtype=np.int64)  # block ids given to the runner
        self._row_tokens = np.zeros(max_seqs, dtype=np.int64)  # prompt + outputs
        self._row_prompt = np.zeros(max_seqs, dtype=np.int64)
        self._row_last_step = np.full(max_seqs, -2, dtype=np.int64)
        self._row_rid: List[str] = [""] * max_seqs
        self._row_out: List[List[int]] = [[] for _ in range(max_seqs)]  # its output tokens
        self._row_all: List[List[int]] = [[] for _ in range(max_seqs)]  # its tokens
        self._row_client = np.zeros(max_seqs, dtype=np.int64)
        # rows whose next output carries more than the token: the first output (prefill
        # stats, events), and (watch) every output of a request with trace headers, stop ids
        # past the core's or a NaN count
        self._row_special = np.zeros(max_seqs, dtype=bool)
        self._row_watch = np.zeros(max_seqs, dtype=bool)
        self._step = 0
        # the pending plan's sampled rows, in plan order: request ids, rows (array, list)
        self._sampled_ids: List[str] = []
        self._sampled_rows = np.zeros(0, dtype=np.int32)
        self._sampled_rows_list: List[int] = []
        self._qid_row: Dict[int, int] = {}  # core id -> block-table row, while it runs
        self._plan_dirty = False  # a request of the pending plan left it
        self._sampled_all = False  # every request of the pending plan samples
        # the lists of the last plan built: its rows (array, list), requests, ids, the
        # requests' output-token and token lists (filled when every request sampled), and its
        # num_scheduled_tokens when every request has one token (copied for each output)
        self._plan_cache: Optional[List[Any]] = None
        self._pending = False
        # what the pending plan's schedule() changed, to be undone if its update fails:
        # (step, row arrays before, finished and preempted ids handed out, the plan's requests,
        # their computed tokens before, the admissions, the waiting order before them, the
        # prefix-cache accumulator they were recorded in)
        self._undo: Optional[Tuple[Any, ...]] = None

    # -- requests ----------------------------------------------------------------------------

    def _check_request(self, request: Request) -> None:
        if request.pooling_params is not None:
            raise _refuse("pooling requests")
        if request.mm_features:
            raise _refuse("multimodal encoder inputs")
        if request.lora_request is not None:
            raise _refuse("LoRA requests")
        if request.use_structured_output:
            raise _refuse("structured outputs (grammar bitmasks)")
        if request.prompt_embeds is not None:
            raise _refuse("prompt embeddings")
        if request.resumable:
            raise _refuse("streaming-input (resumable) requests")
        if request.kv_transfer_params:
            raise _refuse("KV transfer parameters")
        sp = request.sampling_params
        if sp is None:
            raise _refuse("requests without sampling parameters")
        if getattr(sp, "repetition_detection", None) is not None:
            raise _refuse("repetition detection")
        if self._prefix_caching and request.skip_reading_prefix_cache:
            raise _refuse("skipping prefix-cache reads (prompt logprobs) while prefix "
                          "caching is enabled; disable prefix caching for prompt logprobs")

    def _core_add(self, request: Request, tokens: List[int], max_new: int) -> int:
        sp: Any = request.sampling_params
        qid = self._next_qid
        stops = list(sp.stop_token_ids or ())
        core_stops = stops if len(stops) <= _CORE_MAX_STOPS else []
        namespace = b""
        if request.cache_salt:
            namespace = request.cache_salt.encode()
        self._core.add_request(
            qid,
            tokens,
            max_new_tokens=max_new,
            namespace=namespace,
            priority=int(request.priority) if self._priority_policy else 0,
            eos_token_id=sp.eos_token_id,
            stop_token_ids=core_stops,
        )
        self._next_qid += 1
        if len(stops) > _CORE_MAX_STOPS:
            self._extra_stops[qid] = frozenset(stops)
        self._qid[request.request_id] = qid
        self._by_qid[qid] = request
        return qid

    def _max_new(self, request: Request) -> int:
        # vLLM stops a request at max_tokens outputs or at max_model_len tokens
        left = min(request.max_tokens - request.num_output_tokens,
                   self.max_model_len - request.num_tokens)
        if left <= 0:
            raise ValueError(f"request {request.request_id!r} has no token left to generate "
                             f"(max_tokens={request.max_tokens}, max_model_len="
                             f"{self.max_model_len}, {request.num_tokens} tokens)")
        return left

    def _check_fits(self, request: Request, max_new: int) -> None:
        # the core's rule: the K/V of prompt + max_new - 1 tokens must fit the pool (the last
        # token is sampled, never computed); checked here on every path into the adapter, so
        # that a request taken from the backlog later always enters the core
        pages = -(-(request.num_tokens + max_new - 1) // self.block_size)
        if pages > self._num_pages:
            raise ValueError(
                f"request {request.request_id!r} can never run: its {request.num_tokens} tokens "
                f"and up to {max_new} more need {pages} KV blocks, the pool has "
                f"{self._num_pages} (num_gpu_blocks - 1)")

    def _room(self) -> bool:
        c = self._core
        return c.num_waiting + c.num_running < c.max_queued

    def add_request(self, request: Request) -> None:
        """Queue a vLLM request in the core (or, while the core's queue is full or new requests are
        paused, in the adapter); an unsupported request raises ``UnsupportedByQualia`` and changes
        nothing."""
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"duplicate request id {rid!r}")
        self._check_request(request)
        max_new = self._max_new(request)
        self._check_fits(request, max_new)
        # qualia's own prefix cache decides hits: vLLM's per-block hashes are not needed
        request._block_hasher = None
        if self._backlog or not self._room() or self._holding():
            self._backlog.push_back(request)
            self._backlog_arrivals = self._priority_policy
        else:
            self._core_add(request, list(request.all_token_ids), max_new)
        self.requests[rid] = request
        self.waiting.add_request(request)
        if self.log_stats:
            request.record_event(EngineCoreEventType.QUEUED)

    def _holding(self) -> bool:
        # PAUSED_NEW: the running requests go on, nothing waiting is admitted
        return self._pause_state == PauseState.PAUSED_NEW

    def _drain_backlog(self) -> None:
        """Move requests from the backlog into the core's queue while it has room (at the start
        of ``schedule()`` only: it changes nothing else).  A request leaves the backlog only once
        the core holds it."""
        if self._holding():
            return
        backlog = self._backlog
        self._fill_core()
        if backlog and self._backlog_arrivals:
            # (priority) a request that came to the backlog goes ahead of those in the core's
            # queue that it precedes in vLLM's order: the core's queue is put back into the
            # backlog, which hands every request to the core in that order
            self._backlog_arrivals = False
            best = backlog.peek()
            if any(best < r for r in self.waiting if r.request_id in self._qid):
                backlog.push_front(self._take_core_waiting())
                self._fill_core()

    def _fill_core(self) -> None:
        backlog = self._backlog
        while backlog and self._room():
            request = backlog.peek()
            self._core_add(request, list(request.all_token_ids), self._max_new(request))
            backlog.pop()

    def _core_leave(self, request: Request) -> None:
        """Take ``request`` out of the core (it stays one of this scheduler's requests)."""
        qid = self._qid.pop(request.request_id)
        self._core.abort(qid)
        del self._by_qid[qid]
        self._extra_stops.pop(qid, None)
        self._qid_row.pop(qid, None)

    def _take_core_waiting(self) -> List[Request]:
        """Take every request waiting in the core's queue out of it; return them in the
        core's order (priority under the priority policy, then the order they were added)."""
        core_waiting = [self._by_qid[q] for q in sorted(
            self._qid[r.request_id] for r in self.waiting if r.request_id in self._qid)]
        if self._priority_policy:
            core_waiting.sort(key=lambda r: int(r.priority))  # stable: add order within
        for r in core_waiting:
            self._core_leave(r)
        return core_waiting

    def _queue_front(self, requests: List[Request]) -> None:
        """Queue ``requests`` (out of the core, in this order) ahead of every waiting request,
        as vLLM's scheduler puts preempted requests back: at the head of its queue (in the
        priority policy's order under that policy)."""
        if self._holding():
            self._backlog.push_front(requests)
            return
        # the core orders its queue by priority, then by the order requests were added: every
        # request waiting in it is added again behind these
        order = list(requests) + self._take_core_waiting()
        if self._priority_policy:
            order.sort()  # vLLM's Request order: priority, arrival time, request id
        spill: List[Request] = []
        for r in order:
            if spill or not self._room():
                spill.append(r)
            else:
                self._core_add(r, list(r.all_token_ids), self._max_new(r))
        self._backlog.push_front(spill)

    def _preempt_request(self, request: Request, timestamp: float,
                         drop_stale_output: bool = False) -> None:
        """Preempt one running request (already taken out of ``running`` by the caller): its
        pages go back to the core and it waits at the head of the queue.  A token sampled for it
        by a step in flight is dropped (recomputed when it resumes)."""
        self._preempt_out([request], timestamp)

    def _preempt_out(self, requests: List[Request], timestamp: float) -> None:
        for req in requests:
            if req.status != RequestStatus.RUNNING:
                raise ValueError(f"request {req.request_id!r} is not running")
        self._plan_dirty = self._pending
        for req in requests:
            if self.aux_output_connector is not None:
                self.aux_output_connector.request_finished(req)
            self._core_leave(req)
            req.status = RequestStatus.PREEMPTED
            req.num_computed_tokens = 0
            req.num_preemptions += 1
            if self.log_stats:
                req.record_event(EngineCoreEventType.PREEMPTED, timestamp)
            self.reset_preempted_req_ids.add(req.request_id)
        self.waiting.prepend_requests(requests)
        self._queue_front(requests)

    def set_pause_state(self, pause_state: PauseState) -> None:
        """vLLM's pause states: under ``PAUSED_NEW`` the waiting requests leave the core for the
        adapter's queue until the pause ends; ``PAUSED_ALL`` schedules nothing."""
        held = self._holding()
        super().set_pause_state(pause_state)
        if self._holding() and not held:
            # vLLM's PAUSED_NEW admits nothing that waits: the core's queue moves to the
            # adapter until the pause ends
            self._backlog.push_front(self._take_core_waiting())
        # (when the pause ends, the next schedule() moves the backlog into the core)

    def _forget(self, request: Request) -> None:
        rid = request.request_id
        if self.aux_output_connector is not None:
            self.aux_output_connector.request_finished(request)
        qid = self._qid.pop(rid, None)
        if qid is not None:
            self._by_qid.pop(qid, None)
            self._extra_stops.pop(qid, None)
            self._qid_row.pop(qid, None)
        self._in_runner.discard(rid)
        self._hit_tokens.pop(rid, None)
        self.finished_req_ids.add(rid)
        if self.finished_req_ids_dict is not None:
            self.finished_req_ids_dict[request.client_index].add(rid)
        self.requests.pop(rid, None)

    def finish_requests(self, request_ids: Any, finished_status: RequestStatus) -> List[Request]:
        """Abort (or finish) the named requests in the core and in vLLM's books; returns the
        requests finished."""
        assert RequestStatus.is_finished(finished_status)
        if isinstance(request_ids, str):
            ids: Iterable[str] = (request_ids,)
        elif request_ids is None:
            ids = list(self.requests)
        else:
            ids = set(request_ids)
        done: List[Request] = []
        stopped_running = set()
        for rid in ids:
            request = self.requests.get(rid)
            if request is None or request.is_finished():
                continue
            qid = self._qid.get(rid)
            if qid is not None:
                self._core.abort(qid)
            else:
                self._backlog.remove(request)
            if request.status == RequestStatus.RUNNING:
                stopped_running.add(request)
            else:
                self.waiting.remove_request(request)
            request.status = finished_status
            self._forget(request)
            done.append(request)
        if stopped_running:
            self.running = [r for r in self.running if r not in stopped_running]
            self._plan_dirty = self._pending
        return done

    # -- the step ----------------------------------------------------------------------------

    def schedule(self, throttle_prefills: bool = False) -> SchedulerOutput:
        """One core plan as vLLM's ``SchedulerOutput``: admissions as new (or resumed) requests, the
        rest as cached requests, block ids ``page + 1``, the prefix hits as computed tokens. One
        step in flight at a time."""
        if self._pending:
            raise RuntimeError("schedule() called twice without update_from_output(): "
                               "qualia.vllm.Scheduler keeps one step in flight")
        if self._backlog:
            self._drain_backlog()
        self.current_step += 1
        self._step += 1
        step = self._step
        core = self._core
        bs = self.block_size
        log_stats = self.log_stats
        kvm = self.kv_cache_manager
        timestamp = time.monotonic() if log_stats else 0.0
        if self._pause_state == PauseState.PAUSED_ALL or core.num_waiting + core.num_running == 0:
            return self._empty_output()
        sent_before = self._row_sent.copy()
        last_before = self._row_last_step.copy()
        plan = core.schedule()
        self._pending = True
        by_qid = self._by_qid

        preempted = plan.preempted_request_ids
        if len(preempted):
            victims: List[Request] = []
            for qid in preempted.tolist():
                req = by_qid[qid]
                req.status = RequestStatus.PREEMPTED
                req.num_computed_tokens = 0
                req.num_preemptions += 1
                if self.log_stats:
                    req.record_event(EngineCoreEventType.PREEMPTED, timestamp)
                if self.aux_output_connector is not None:
                    self.aux_output_connector.request_finished(req)
                self.reset_preempted_req_ids.add(req.request_id)
                victims.append(req)
            gone = set(victims)
            self.running = [r for r in self.running if r not in gone]
            # vLLM puts each victim at the head of the queue, the last one first
            self.waiting.prepend_requests(victims[::-1])
            if self._holding():
                for req in victims:
                    self._core_leave(req)
                self._backlog.push_front(victims[::-1])

        n = len(plan.request_ids)
        if n == 0:
            core.update([])
            self._pending = False
            return self._empty_output()
        rows = plan.block_table_rows
        qsl = plan.query_start_loc
        ntok = qsl[1:] - qsl[:-1]
        seq = plan.seq_lens.astype(np.int64)
        need = (seq + (bs - 1)) // bs
        comp = seq - ntok
        k = len(plan.new_request_ids)
        m = n - k
        table = plan.block_table
        row_req = self._row_req

        # The plan's requests, from their rows.  A row changes hands only at an admission, so
        # a plan without admissions over the same rows as the last one built has the same
        # requests (the decode steady state): its lists are reused.
        cache: List[Any] = self._plan_cache or [None]
        reuse = (k == 0 and cache[0] is not None and len(cache[0]) == n
                 and np.array_equal(cache[0], rows))
        if reuse:
            rows_list = cache[1]
            plan_reqs = cache[2]
        else:
            rows_list = rows.tolist()
            plan_reqs = [row_req[r] for r in rows_list[:m]]
        # admissions (the plan's tail): new to the runner, or resumed after a preemption
        new_reqs: List[Request] = []
        new_blocks: List[Tuple[List[int], ...]] = []
        res_pos: List[int] = []
        resumed_blocks: List[Optional[Tuple[List[int], ...]]] = []
        admitted: List[Tuple[Request, RequestStatus, int, bool]] = []
        waiting_before: List[str] = []
        if k:
            waiting_before = list(self.waiting.ids())
            qids = plan.request_ids[m:].tolist()
            arows = rows[m:].tolist()
            acomp = comp[m:].tolist()
            aneed = need[m:].tolist()
            for j in range(k):
                req = by_qid[qids[j]]
                row = arows[j]
                row_req[row] = req
                plan_reqs.append(req)
                self._row_sent[row] = aneed[j]
                self._row_tokens[row] = req.num_tokens
                self._row_prompt[row] = req.num_prompt_tokens
                self._row_last_step[row] = -2
                self._row_rid[row] = req.request_id
                self._qid_row[qids[j]] = row
                self._row_out[row] = req._output_token_ids
                self._row_all[row] = req._all_token_ids
                self._row_client[row] = req.client_index
                self._row_watch[row] = bool(req.trace_headers is not None
                                            or req.num_nans_in_logits
                                            or qids[j] in self._extra_stops)
                self.waiting.remove_request(req)
                self.running.append(req)
                blocks = ((table[row, :aneed[j]] + 1).tolist(),)
                hit = acomp[j]
                req.num_computed_tokens = hit
                admitted.append((req, req.status, len(req.events),
                                 req.request_id not in self._in_runner))
                if self.log_stats:
                    req.record_event(EngineCoreEventType.SCHEDULED, timestamp)
                first = req.status == RequestStatus.WAITING
                req.status = RequestStatus.RUNNING
                self._row_special[row] = bool(req.events) or req.prefill_stats is not None
                if log_stats:
                    # the query and hits of this admission, as vLLM counts them (a request
                    # preempted before counts as a preempted query)
                    kvm.record_prefix_cache_stats(req, hit)
                if first and req.prefill_stats is not None:
                    req.prefill_stats.set(num_prompt_tokens=req.num_prompt_tokens,
                                          num_local_cached_tokens=hit,
                                          num_external_cached_tokens=0)
                if req.request_id in self._in_runner:
                    res_pos.append(m + j)
                    resumed_blocks.append(blocks)
                else:
                    if first:
                        self._hit_tokens[req.request_id] = hit
                    new_reqs.append(req)
                    new_blocks.append(blocks)

        # running requests: new block ids only where the context passed into a new page
        new_block_ids: List[Optional[Tuple[List[int], ...]]] = [None] * m
        if m:
            rrows = rows[:m]
            sent = self._row_sent[rrows]
            grow = np.flatnonzero(need[:m] > sent)
            if len(grow):
                gneed = need[grow]
                gsent = sent[grow]
                grows = rrows[grow]
                self._row_sent[grows] = gneed
                count = gneed - gsent
                if int(count.max()) == 1:
                    # one new page each (decodes): one gather
                    for i, b in zip(grow.tolist(), (table[grows, gsent] + 1).tolist()):
                        new_block_ids[i] = ([b],)
                else:
                    # every request's new entries in one gather, then cut
                    ends = np.cumsum(count)
                    starts = ends - count
                    cols = np.arange(int(ends[-1])) - np.repeat(starts - gsent, count)
                    flat = (table[np.repeat(grows, count), cols] + 1).tolist()
                    for i, a, z in zip(grow.tolist(), starts.tolist(), ends.tolist()):
                        new_block_ids[i] = (flat[a:z],)
        # the runner's cached requests: the running ones, then the resumed ones
        if reuse:
            plan_ids = cache[3]
        else:
            row_rid = self._row_rid
            plan_ids = [row_rid[r] for r in rows_list]
            cache = self._plan_cache = [rows.copy(), rows_list, plan_reqs, plan_ids, None, None,
                                        None]
        if res_pos:
            cpos = np.concatenate([np.arange(m), np.asarray(res_pos)])
            crows = rows[cpos]
            ccomp = comp[cpos].tolist()
            cids = plan_ids[:m] + [plan_ids[i] for i in res_pos]
        else:
            cpos = None
            crows = rows[:m]
            ccomp = comp[:m].tolist()
            cids = plan_ids[:m]
        # all token ids of the cached requests the runner did not see in the previous step
        all_token_ids: Dict[str, List[int]] = {}
        stale = np.flatnonzero(self._row_last_step[crows] != step - 1)
        for i in stale.tolist():
            req = plan_reqs[i if cpos is None else int(cpos[i])]
            all_token_ids[req.request_id] = list(req.all_token_ids)
        cached = CachedRequestData(
            req_ids=cids,
            resumed_req_ids={plan_ids[i] for i in res_pos},
            new_token_ids=[],
            all_token_ids=all_token_ids,
            new_block_ids=new_block_ids + resumed_blocks,
            num_computed_tokens=ccomp,
            num_output_tokens=(self._row_tokens[crows] - self._row_prompt[crows]).tolist(),
        )
        new_data = [NewRequestData.from_request(r, b) for r, b in zip(new_reqs, new_blocks)]
        for r in new_reqs:
            self._in_runner.add(r.request_id)

        total = int(qsl[-1])
        if total == n:  # one token each
            if cache[6] is None:
                cache[6] = dict.fromkeys(plan_ids, 1)
            num_scheduled = cache[6].copy()
        else:
            num_scheduled = dict(zip(plan_ids, ntok.tolist()))
        # computed tokens move when the plan is built (as vLLM's scheduler does)
        for r, s in zip(plan_reqs, seq.tolist()):
            r.num_computed_tokens = s
        self._row_last_step[rows] = step
        # the sampled rows: requests whose chunk reaches their last known token
        sampling = seq == self._row_tokens[rows]
        self._plan_dirty = False
        self._sampled_all = bool(sampling.all())
        if self._sampled_all:
            self._sampled_ids = plan_ids
            self._sampled_rows = rows.copy()
            self._sampled_rows_list = rows_list
        else:
            sidx = np.flatnonzero(sampling)
            self._sampled_ids = [plan_ids[i] for i in sidx.tolist()]
            self._sampled_rows = rows[sidx]
            self._sampled_rows_list = self._sampled_rows.tolist()
        out = SchedulerOutput(
            scheduled_new_reqs=new_data,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=num_scheduled,
            total_num_scheduled_tokens=total,
            scheduled_spec_decode_tokens={},
            scheduled_encoder_inputs={},
            preempted_req_ids=self.reset_preempted_req_ids,
            finished_req_ids=self.finished_req_ids,
            free_encoder_mm_hashes=[],
        )
        self._undo = (step, sent_before, last_before, self.finished_req_ids,
                      self.reset_preempted_req_ids, plan_reqs[:m], comp, admitted,
                      waiting_before, kvm.prefix_cache_stats if log_stats else None)
        self.finished_req_ids = set()
        self.reset_preempted_req_ids = set()
        return out

    def _undo_schedule(self) -> None:
        """Undo what the pending plan's ``schedule()`` did, after the core discarded the plan:
        the plan's requests are as they were before it (an admission waits again where it
        waited, the running requests' computed tokens go back), the next output reports again
        the finished and preempted ids this one reported, and the admissions' prefix-cache
        records are taken back.  The core's preemptions of the step stand (the core keeps
        them): those requests stay preempted, reported by the next output.  A request aborted
        or preempted while the plan was pending stays so."""
        undo = self._undo
        self._undo = None
        if undo is None:
            return
        (step, sent, last, finished, preempted, running, comp, admitted, waiting_before,
         stats) = undo
        self._step = step - 1
        self.current_step -= 1
        self._row_sent[:] = sent
        self._row_last_step[:] = last
        self._plan_cache = None
        self.finished_req_ids |= finished
        self.reset_preempted_req_ids |= preempted
        requests = self.requests
        for req, c in zip(running, comp.tolist()):
            if requests.get(req.request_id) is req and req.status == RequestStatus.RUNNING:
                req.num_computed_tokens = c
        undone: Dict[str, Request] = {}
        kvm = self.kv_cache_manager
        if stats is not kvm.prefix_cache_stats:
            stats = None  # already handed to make_stats(): it stands
        hits = comp[len(running):].tolist()
        for (req, status, n_events, new), hit in zip(admitted, hits):
            rid = req.request_id
            if new:
                self._in_runner.discard(rid)
            if requests.get(rid) is not req or req.status != RequestStatus.RUNNING:
                continue  # aborted or preempted while the plan was pending
            if new and status == RequestStatus.WAITING:
                self._hit_tokens.pop(rid, None)
            req.status = status
            req.num_computed_tokens = 0
            del req.events[n_events:]
            if stats is not None and kvm.prefix_cache_lookup_enabled(req):
                # take back what record_prefix_cache_stats recorded at the admission
                if req.num_preemptions > 0:
                    stats.preempted_requests -= 1
                    stats.preempted_queries -= req.num_tokens
                    stats.preempted_hits -= hit
                else:
                    stats.requests -= 1
                    stats.queries -= req.num_tokens
                    stats.hits -= hit
            undone[rid] = req
        if undone:
            self.running = [r for r in self.running if r.request_id not in undone]
            self.waiting.restore_order(waiting_before, undone)

    def _empty_output(self) -> SchedulerOutput:
        out = SchedulerOutput.make_empty()
        out.finished_req_ids = self.finished_req_ids
        out.preempted_req_ids = self.reset_preempted_req_ids
        self.finished_req_ids = set()
        self.reset_preempted_req_ids = set()
        self._sampled_ids = []
        return out

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           model_runner_output: Any) -> Dict[int, EngineCoreOutputs]:
        """Hand the model runner's sampled tokens to the core's ``update`` and build vLLM's outputs
        (finish reasons in vLLM's order: eos, a stop id, length)."""
        result: Dict[int, EngineCoreOutputs] = {}
        if self._pending:
            self._pending = False
            self._take_tokens(model_runner_output, result)
        self._undo = None
        self._sampled_ids = []
        fin = self.finished_req_ids_dict
        if fin:
            for client, ids in fin.items():
                eco = result.get(client)
                if eco is None:
                    result[client] = EngineCoreOutputs(finished_requests=ids)
                else:
                    eco.finished_requests = ids
            fin.clear()
        stats = self.make_stats()
        if stats is not None:
            eco = next(iter(result.values()), None)
            if eco is None:
                result[0] = eco = EngineCoreOutputs()
            eco.scheduler_stats = stats
        return result

    def _take_tokens(self, mro: Any, result: Dict[int, EngineCoreOutputs]) -> None:
        """The sampled tokens of the pending plan: into the core, onto the vLLM requests, and
        their outputs into ``result`` (by client)."""
        rids = self._sampled_ids
        if not rids:
            self._core.update(())
            return
        rows = self._sampled_rows
        rlist = self._sampled_rows_list
        sampled = mro.sampled_token_ids
        index = mro.req_id_to_index
        row_req = self._row_req  # rows change hands only at admissions, in schedule()
        live: Optional[List[bool]] = None
        if self._plan_dirty:
            # a request of the plan was aborted or preempted while the step ran: the core
            # ignores its row, and it gets no output
            requests = self.requests
            live = []
            for rid, row in zip(rids, rlist):
                r = row_req[row]
                live.append(requests.get(rid) is r and r is not None
                            and r.status == RequestStatus.RUNNING)
        toks: List[int] = []
        try:
            if live is not None:
                got = [sampled[index[rid]] if ok else (0,) for rid, ok in zip(rids, live)]
            elif (mro.req_ids == rids and len(sampled) == len(rids)
                  and index[rids[-1]] == len(rids) - 1):
                got = sampled  # the runner kept the plan's order
            else:
                got = [sampled[i] for i in map(index.__getitem__, rids)]
            toks = list(_chain(got))
            # exactly one token each: as many tokens as requests, none without one
            bad = len(toks) != len(got) or min(map(len, got)) != 1
        except (KeyError, IndexError, ValueError, TypeError):
            bad = True
        if bad:
            self._core.discard_plan()
            self._undo_schedule()
            for rid, ok in zip(rids, live or [True] * len(rids)):
                i = index.get(rid)
                n = len(sampled[i]) if i is not None and 0 <= i < len(sampled) else 0
                if ok and n != 1:
                    raise RuntimeError(
                        f"the model runner returned {n} tokens for request {rid!r}, which "
                        f"qualia's plan samples once in this step")
            raise RuntimeError("the model runner's sampled tokens do not match qualia's plan")
        done = self._core.update(toks)
        self._row_tokens[rows] += 1
        if live is not None:
            keep = [i for i, ok in enumerate(live) if ok]
            rids = [rids[i] for i in keep]
            toks = [toks[i] for i in keep]
            rlist = [rlist[i] for i in keep]
            rows = rows[keep]
        if not rids:
            return
        # vLLM's Request.append_output_token_ids, without its block hashing (qualia's own
        # cache decides hits), for every request at once
        cache = self._plan_cache
        if live is None and self._sampled_all and cache is not None and cache[4] is not None:
            outl, alll = cache[4], cache[5]
        else:
            row_out = self._row_out
            row_all = self._row_all
            outl = [row_out[r] for r in rlist]
            alll = [row_all[r] for r in rlist]
            if live is None and self._sampled_all and cache is not None:
                cache[4], cache[5] = outl, alll
        _consume(map(list.append, outl, toks))
        _consume(map(list.append, alll, toks))
        outs: List[EngineCoreOutput] = list(map(EngineCoreOutput, rids, [[t] for t in toks]))
        # the outputs that carry more than the token: a stop, the first output (prefill
        # stats, events), trace headers, stop ids past the core's, and anything the runner
        # returned for some requests (logprobs, sampling masks, prompt logprobs, NaN counts)
        logprobs = mro.logprobs or None
        prompt_lp = mro.prompt_logprobs_dict or None
        prompt_id_lp = mro.prompt_token_id_logprobs_dict or None
        nans = mro.num_nans_in_logits
        masks = mro.sampling_masks if self.return_sampling_mask else None
        finished_qids = {f.request_id for f in done}
        if (logprobs is not None or prompt_lp or prompt_id_lp or nans is not None
                or masks is not None):
            special: Iterable[int] = range(len(rids))
        else:
            marked = self._row_special | self._row_watch
            if finished_qids:
                qid_row = self._qid_row
                marked[[qid_row[q] for q in finished_qids]] = True
            special = np.flatnonzero(marked[rows]).tolist()
        self._row_special[rows] = False
        stopped: List[Request] = []
        for i in special:
            row = rlist[i]
            req = row_req[row]
            assert req is not None
            outs[i] = self._full_output(req, row, toks[i], finished_qids, index, logprobs,
                                        masks, prompt_lp, prompt_id_lp, nans, stopped)
        clients = self._row_client[rows]
        if clients.min() == clients.max():
            result[int(clients[0])] = EngineCoreOutputs(outputs=outs)
        else:
            by_client: Dict[int, List[EngineCoreOutput]] = {}
            for c, o in zip(clients.tolist(), outs):
                by_client.setdefault(c, []).append(o)
            for c, lst in by_client.items():
                result[c] = EngineCoreOutputs(outputs=lst)
        if stopped:
            gone = set(stopped)
            self.running = [r for r in self.running if r not in gone]
            for req in stopped:
                self._forget(req)

    def _full_output(self, req: Request, row: int, tok: int, finished_qids: set,
                     index: Dict[str, int], logprobs: Any, masks: Any, prompt_lp: Any,
                     prompt_id_lp: Any, nans: Any, stopped: List[Request]) -> EngineCoreOutput:
        """The output of one request whose token was appended: stop, logprobs, stats."""
        rid = req.request_id
        finish = None
        qid = self._qid[rid]
        extra = self._extra_stops.get(qid)
        if qid in finished_qids or (extra is not None and tok in extra):
            sp: Any = req.sampling_params
            if tok == sp.eos_token_id:
                req.status = RequestStatus.FINISHED_STOPPED
            elif tok in (sp.stop_token_ids or ()):
                req.status = RequestStatus.FINISHED_STOPPED
                req.stop_reason = tok
            else:
                req.status = RequestStatus.FINISHED_LENGTH_CAPPED
            if qid not in finished_qids:
                self._core.abort(qid)
            finish = req.get_finished_reason()
            stopped.append(req)
        new_logprobs = None
        # vLLM's test: sample logprobs asked for by count or by token ids (num_logprobs)
        if logprobs is not None and req.sampling_params.num_logprobs is not None:
            new_logprobs = logprobs.slice_request(index[rid], 1)
        new_mask = None
        if masks is not None:
            new_mask = masks.slice_request(index[rid], 1)
        prefill_stats = req.prefill_stats
        if prefill_stats is not None:
            req.prefill_stats = None
            prefill_stats.finalize(self._hit_tokens.get(rid, 0))
        events = None
        if req.events:
            events = req.events
            req.events = []
        if nans is not None and rid in nans:
            req.num_nans_in_logits = nans[rid]
            if req.num_nans_in_logits:
                self._row_watch[row] = True  # every later output carries the count
        return EngineCoreOutput(
            request_id=rid,
            new_token_ids=[tok],
            finish_reason=finish,
            new_logprobs=new_logprobs,
            new_sampling_mask=new_mask,
            new_prompt_logprobs_tensors=prompt_lp.get(rid) if prompt_lp else None,
            prompt_token_id_logprobs=prompt_id_lp.get(rid) if prompt_id_lp else None,
            stop_reason=req.stop_reason,
            events=events,
            prefill_stats=prefill_stats,
            trace_headers=req.trace_headers,
            num_nans_in_logits=req.num_nans_in_logits,
        )

    # -- what vLLM's engine asks -------------------------------------------------------------

    def get_grammar_bitmask(self, scheduler_output: SchedulerOutput) -> None:
        """None: structured outputs are refused at ``add_request``."""
        return None

    def update_draft_token_ids(self, draft_token_ids: Any) -> None:
        """Refused: speculative decoding is not supported."""
        raise _refuse("speculative decoding")

    def update_draft_token_ids_in_output(self, draft_token_ids: Any,
                                         scheduler_output: SchedulerOutput) -> None:
        """Refused: speculative decoding is not supported."""
        raise _refuse("speculative decoding")

    def get_request_counts(self) -> Tuple[int, int]:
        """``(running, waiting)`` request counts."""
        return len(self.running), len(self.waiting)

    def get_num_unfinished_requests(self) -> int:
        """Requests not finished, as vLLM counts them under the pause state."""
        if self._pause_state == PauseState.PAUSED_ALL:
            return 0
        if self._pause_state == PauseState.PAUSED_NEW:
            return len(self.running)  # what waits stays queued until the pause ends
        return len(self.running) + len(self.waiting)

    def has_finished_requests(self) -> bool:
        """Whether requests finished since the previous step wait to be reported."""
        return bool(self.finished_req_ids)

    def has_requests(self) -> bool:
        """Whether any request is unfinished or finished and not yet reported."""
        return self.has_unfinished_requests() or self.has_finished_requests()

    def get_kv_cache_usage(self) -> float:
        """``1 - free / pages``: cached pages no request holds count as free."""
        # pages no request holds (free, or cached and reclaimable) are not in use
        return 1.0 - self._core.free_pages / self._num_pages

    def make_stats(self, spec_decoding_stats: Any = None, kv_connector_stats: Any = None,
                   cudagraph_stats: Any = None, perf_stats: Any = None,
                   ec_connector_stats: Any = None) -> Optional[SchedulerStats]:
        """vLLM's ``SchedulerStats`` of the step (None without ``log_stats``), with the prefix-cache
        queries and hits the core's admissions recorded."""
        if not self.log_stats:
            return None
        # the prefix-cache queries and hits are recorded in vLLM's accumulator at admission
        # (kv_cache_manager.prefix_cache_stats, which vLLM's tests and engine read)
        prefix_stats = self.kv_cache_manager.make_prefix_cache_stats()
        assert prefix_stats is not None  # log_stats
        return SchedulerStats(
            num_running_reqs=len(self.running),
            num_waiting_reqs=len(self.waiting),
            kv_cache_usage=self.get_kv_cache_usage(),
            prefix_cache_stats=prefix_stats,
            cudagraph_stats=cudagraph_stats,
            perf_stats=perf_stats,
        )

    def reset_prefix_cache(self, reset_running_requests: bool = False,
                           reset_connector: bool = False) -> bool:
        """Clear qualia's prefix cache; with ``reset_running_requests`` every running request first
        goes back to waiting. Returns False when requests run and may not be reset."""
        if self.running and not reset_running_requests:
            return False
        if self._pending:
            # the step in flight is dropped (its outputs are not delivered): every request it
            # scheduled is requeued below and computes its tokens again
            self._core.discard_plan()
            self._pending = False
            self._undo = None
            self._sampled_ids = []
        if reset_running_requests and self.running:
            # every running request waits again, at the head of the queue in its order, with
            # its tokens so far; the runner is told it was preempted and resumes it from the
            # block ids of its next admission
            running, self.running = self.running, []
            self._preempt_out(running, time.monotonic())
        self._core.clear_cache()
        stats = self.kv_cache_manager.prefix_cache_stats
        if stats is not None:
            stats.reset = True
        if self.aux_output_connector is not None:
            self.aux_output_connector.reset()
        return True
