"""One replica: an engine (a step scheduler and a step backend) that the router drives one step
at a time; the body of the Ray actor (see :mod:`qualia.cluster`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

import qualia
from qualia.errors import StepError

__all__ = ["DEFAULT_KEY", "ReplicaConfig", "Replica", "make_scheduler", "make_backend",
           "model_weights", "HashStepBackend"]

DEFAULT_KEY = bytes(range(16))   # every replica and the router share the cache key


@dataclass
class ReplicaConfig:
    """What every replica is built with.  ``scheduler``: ``"auto"`` (the compiled core's
    ``qualia.Scheduler`` when it has the step API, else the pure-Python twin), ``"core"``,
    ``"twin"``, or a callable taking the scheduler's keyword arguments.  ``backend``:
    ``"hash"`` (the hash rule, token = hash(request, position, last token)) or ``"model"``
    (the numpy model's own step runner, ``PagedModelBackend.execute_step``: one forward over
    the plan's mixed batch, K/V through ``slot_mapping``, greedy).  ``max_num_seqs`` (None:
    ``max_requests``) and ``max_prefill_chunk`` (None: only the token budget) shape each
    step as in the single engine."""

    max_requests: int = 16
    num_blocks: int = 96
    page_tokens: int = 16
    logical_pages: int = 16
    max_num_batched_tokens: int = 512
    max_num_seqs: Optional[int] = None
    max_prefill_chunk: Optional[int] = None
    max_queued: Optional[int] = None
    cache_key: bytes = DEFAULT_KEY
    event_capacity: int = 8192
    scheduler: Any = "auto"
    backend: str = "hash"
    vocab: int = 32000
    model_seed: int = 0
    eos_token_id: Optional[int] = None

    @property
    def queue_limit(self) -> int:
        return 4 * self.max_requests if self.max_queued is None else self.max_queued


def make_scheduler(config: ReplicaConfig):
    """The step scheduler of one replica (see :class:`ReplicaConfig`)."""
    kw: Dict[str, Any] = dict(max_requests=config.max_requests, num_blocks=config.num_blocks,
                              page_tokens=config.page_tokens,
                              logical_pages=config.logical_pages, cache_key=config.cache_key,
                              event_capacity=config.event_capacity,
                              max_num_batched_tokens=config.max_num_batched_tokens,
                              max_num_seqs=config.max_num_seqs,
                              max_prefill_chunk=config.max_prefill_chunk,
                              max_queued=config.queue_limit, vocab_size=config.vocab)
    kind = config.scheduler
    if callable(kind):
        return kind(**kw)
    core_has_step = hasattr(qualia.Scheduler, "add_request")
    if kind == "core" or (kind == "auto" and core_has_step):
        return qualia.Scheduler(**kw)
    if kind in ("twin", "auto"):
        from qualia.twin import StepScheduler
        return StepScheduler(**kw)
    raise ValueError(f"scheduler must be 'auto', 'core', 'twin' or a callable, got {kind!r}")


class HashStepBackend:
    """A step backend over the hash rule (``qualia.hash_next_token``): the token sampled for a
    row is the rule applied to the row's last token at its position, as the C hash backend
    does, so outputs do not depend on how a request was batched, chunked, preempted or moved."""

    def __init__(self, vocab: int = 32000) -> None:
        self.vocab = int(vocab)

    def execute_step(self, plan) -> np.ndarray:
        rows = np.asarray(plan.logits_indices)
        toks = np.asarray(plan.input_ids)[rows].tolist()
        pos = np.asarray(plan.positions)[rows].tolist()
        rids = np.asarray(plan.sampled_request_ids).tolist()
        h, v = qualia.hash_next_token, self.vocab
        return np.array([h(r, p, t, v) for r, p, t in zip(rids, pos, toks)], dtype=np.uint32)


def model_weights(config: ReplicaConfig):
    """The numpy model's weights every replica of ``config`` uses (deterministic in the seed),
    which ``--check`` hands to the dense model."""
    from qualia.model import ModelConfig, ModelWeights
    return ModelWeights.random(ModelConfig(seed=config.model_seed, vocab=config.vocab))


def make_backend(config: ReplicaConfig):
    if config.backend == "hash":
        return HashStepBackend(config.vocab)
    if config.backend == "model":
        from qualia.model import PagedModelBackend
        return PagedModelBackend(model_weights(config), config.num_blocks, config.page_tokens)
    raise ValueError(f"backend must be 'hash' or 'model', got {config.backend!r}")


class Replica:
    """One engine: a step scheduler and its backend.  The body of the Ray actor; also usable
    in-process.  :meth:`step` is the only call the router makes."""

    def __init__(self, replica_id: int, config: ReplicaConfig) -> None:
        self.replica_id = int(replica_id)
        self.config = config
        self.sched = make_scheduler(config)
        self.backend = make_backend(config)
        # the twin keeps the cache in its facade; the core's Scheduler is its own facade
        self.facade = getattr(self.sched, "facade", self.sched)
        self.implementation = ("core" if isinstance(self.sched, qualia.Scheduler)
                               else "twin" if self.facade is not self.sched
                               else type(self.sched).__name__)
        self.steps = 0

    def ping(self) -> int:
        return self.replica_id

    def describe(self) -> Dict[str, Any]:
        """What this replica runs: its scheduler (``"core"``: the compiled ``qualia.Scheduler``;
        ``"twin"``) and its backend's class."""
        return dict(replica=self.replica_id, implementation=self.implementation,
                    backend=type(self.backend).__name__)

    def _hit_tokens(self) -> int:
        # prompt tokens the cache has served so far (for a plan that does not count them)
        return int(self.facade.cache_stats().hit_tokens)

    def step(self, requests: Sequence[Tuple[int, Any, int, bytes]] = ()) -> Dict[str, Any]:
        """Queue ``requests`` ((id, prompt tokens, max_new_tokens, namespace) each), run one
        engine step when anything is unfinished, and report: tokens sampled (id -> token),
        finished requests (id, outputs, reason), refused requests, KV events, load, counters."""
        t0 = time.perf_counter()
        rejected: List[int] = []
        failed: List[Tuple[int, str]] = []
        for rid, prompt, max_new, ns in requests:
            try:
                self.sched.add_request(rid, np.asarray(prompt, dtype=np.uint32),
                                       max_new_tokens=max_new, namespace=ns,
                                       eos_token_id=self.config.eos_token_id)
            except StepError.QueueFull:
                rejected.append(rid)
            except (StepError, ValueError, TypeError, OverflowError) as exc:
                failed.append((rid, f"{type(exc).__name__}: {exc}"))
        sampled: Dict[int, int] = {}
        finished: List[Tuple[int, List[int], str]] = []
        rep: Dict[str, Any] = dict(prefill_tokens=0, decode_tokens=0, cached_tokens=0,
                                   preempted=0, admitted=0, stepped=False)
        if self.sched.has_unfinished():
            hits_before = self._hit_tokens()
            plan = self.sched.schedule()
            try:
                ids = np.asarray(self.backend.execute_step(plan), dtype=np.uint32)
            except BaseException:
                discard = getattr(self.sched, "discard_plan", None)
                if discard is not None:
                    discard()
                raise
            rids = np.asarray(plan.sampled_request_ids).tolist()
            rep.update(prefill_tokens=int(plan.num_prefill_tokens),
                       decode_tokens=int(plan.num_decode_tokens),
                       cached_tokens=int(plan.num_cached_tokens)
                       if hasattr(plan, "num_cached_tokens")
                       else self._hit_tokens() - hits_before,
                       preempted=len(plan.preempted_request_ids),
                       admitted=len(plan.new_request_ids), stepped=True)
            done = self.sched.update(ids)
            sampled = dict(zip(rids, ids.tolist()))
            finished = [(int(f.request_id), np.asarray(f.output_tokens).tolist(),
                         f.finish_reason) for f in done]
            self.steps += 1
        f = self.facade
        rep.update(replica=self.replica_id, implementation=self.implementation,
                   sampled=sampled, finished=finished, rejected=rejected, failed=failed,
                   events=f.drain_events(),
                   running=int(self.sched.num_running), waiting=int(self.sched.num_waiting),
                   free_pages=int(f.free_pages), num_blocks=int(f.num_blocks),
                   step_s=time.perf_counter() - t0)
        return rep
