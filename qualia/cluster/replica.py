"""One replica: an engine (a step scheduler and a step backend) that the router drives one step
at a time; the body of the Ray actor (see :mod:`qualia.cluster`)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from qualia.errors import StepError

from ..sim.adapters import DecodeRuleSteps
from ..sim.clock import StepWork
from ..sim.config import EngineConfig, make_step_scheduler, step_scheduler_class

__all__ = ["DEFAULT_KEY", "ReplicaConfig", "Replica", "make_scheduler", "make_backend",
           "model_weights"]

DEFAULT_KEY = bytes(range(16))   # every replica and the router share the cache key


@dataclass(frozen=True)
class ReplicaConfig(EngineConfig):
    """What every replica is built with: one engine's :class:`~qualia.sim.config.EngineConfig`
    (the replicas share the cache key, so the router computes the page identities they cache)
    and its backend: ``"hash"`` (the hash rule, token = hash(request, position, last token))
    or ``"model"`` (the numpy model's own step runner, ``PagedModelBackend.execute_step``: one
    forward over the plan's mixed batch, K/V through ``slot_mapping``, greedy) over the
    weights of ``model_seed``."""

    max_num_seqs: int = 16
    """Sequences one step of a replica runs at most."""
    max_num_batched_tokens: int = 512
    """A replica's step budget, in tokens."""
    vocab_size: Optional[int] = 32000
    """The vocabulary of the backend (sampled ids are checked against it)."""
    cache_key: Optional[bytes] = DEFAULT_KEY
    """The page-hash key every replica shares, so that the router computes the identities they
    cache."""
    event_capacity: Optional[int] = 8192
    """The KV event ring of each replica (the router drains it every step)."""
    backend: str = "hash"
    """``"hash"`` or ``"model"``."""
    model_seed: int = 0
    """The seed of the numpy model's weights."""

    @property
    def vocab(self) -> int:
        """The backend's vocabulary: ``vocab_size``, or 32000 when None."""
        return 32000 if self.vocab_size is None else self.vocab_size


def make_scheduler(config: ReplicaConfig):
    """The step scheduler of one replica (:func:`qualia.sim.config.make_step_scheduler`)."""
    return make_step_scheduler(config.checked())


def model_weights(config: ReplicaConfig):
    """The numpy model's weights every replica of ``config`` uses (deterministic in the seed),
    which ``--check`` hands to the dense model."""
    from qualia.model import ModelConfig, ModelWeights
    return ModelWeights.random(ModelConfig(seed=config.model_seed, vocab=config.vocab))


def make_backend(config: ReplicaConfig):
    if config.backend == "hash":
        return DecodeRuleSteps(config.vocab)
    if config.backend == "model":
        from qualia.model import PagedModelBackend
        return PagedModelBackend(model_weights(config), config.num_pages, config.page_tokens)
    raise ValueError(f"backend must be 'hash' or 'model', got {config.backend!r}")


class Replica:
    """One engine: a step scheduler and its backend.  The body of the Ray actor; also usable
    in-process.  :meth:`step` is the only call the router makes."""

    def __init__(self, replica_id: int, config: ReplicaConfig) -> None:
        self.replica_id = int(replica_id)
        self.config = config
        self.sched = make_scheduler(config)
        self.backend = make_backend(config)
        # the twin keeps the cache in its facade; the core's StepScheduler owns its cache
        self.facade = getattr(self.sched, "facade", self.sched)
        self.implementation = ("core" if isinstance(self.sched, step_scheduler_class("core"))
                               else "twin" if self.facade is not self.sched
                               else type(self.sched).__name__)
        self.steps = 0

    def ping(self) -> int:
        """The replica's id: a cheap call that tells the router the actor is alive."""
        return self.replica_id

    def describe(self) -> Dict[str, Any]:
        """What this replica runs: its scheduler (``"core"``: the compiled ``qualia.StepScheduler``;
        ``"twin"``) and its backend's class."""
        return dict(replica=self.replica_id, implementation=self.implementation,
                    backend=type(self.backend).__name__)

    def drain(self) -> Any:
        """Abort every request the replica holds (those of a run that ended before they
        finished), so that the next run starts with none; its cache stays.  Returns the KV
        events since its last step (for the router's index).  ``RuntimeError`` when requests
        are left (the router then kills the replica)."""
        for rid in list(self.sched.requests()):
            try:
                self.sched.abort(int(rid))
            except StepError.UnknownRequest:   # a group member, aborted with its parent
                pass
        if self.sched.has_unfinished():
            raise RuntimeError(f"replica {self.replica_id}: requests left after aborting "
                               "every one")
        return self.facade.drain_events()

    def _hit_tokens(self) -> int:
        # prompt tokens the cache has served so far (for a plan that does not count them)
        return int(self.facade.cache_stats().hit_tokens)

    def step(self, requests: Sequence[Tuple[int, Any, int, bytes]] = ()) -> Dict[str, Any]:
        """Queue ``requests`` ((id, prompt tokens, max_new_tokens, namespace) each), run one
        engine step when anything is unfinished, and report: tokens sampled (id -> token),
        finished requests (id, outputs, reason), refused requests, KV events, load, counters,
        the step's work for the serving clock (``work``, a
        :class:`qualia.sim.clock.StepWork`; None when it did not step) and its measured time
        (``step_s``)."""
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
        work = None
        lookups_before = int(self.facade.cache_stats().lookup_tokens)
        if self.sched.has_unfinished():
            hits_before = self._hit_tokens()
            plan = self.sched.schedule()
            work = StepWork.from_plan(plan)
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
        rep.update(work=work, lookup_tokens=int(f.cache_stats().lookup_tokens) - lookups_before)
        rep.update(replica=self.replica_id, implementation=self.implementation,
                   sampled=sampled, finished=finished, rejected=rejected, failed=failed,
                   events=f.drain_events(),
                   running=int(self.sched.num_running), waiting=int(self.sched.num_waiting),
                   free_pages=int(f.free_pages), num_pages=self.config.num_pages,
                   step_s=time.perf_counter() - t0)
        return rep
