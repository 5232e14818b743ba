"""The step backends the simulator drives: each turns ``execute_step(plan)`` into what a kind of
backend computes (docs/DESIGN.md, "The engine step").

* :class:`ModelSteps`: a model with the per-sequence ``prefill(tokens, start_position,
  block_table)`` of :class:`qualia.model.PagedModelBackend`, driven request by request over the
  plan (the copy-on-write copies first); greedy;
* :class:`PlanModelSteps`: the model's batched step (``step_logits`` and its keyed
  ``sample``): one forward per plan, one token per sampled row, and for a plan with beam rows
  each row's ``num_topk`` best ids with their log-probabilities, what ``update`` takes;
* :class:`DecodeRuleSteps`: a decode rule (the C ``qualia.HashBackend``'s
  ``qualia.hash_next_token``, or a backend's own ``next_token``), whose token for a sampled row
  depends on the request id, the last token's position and the token only.

:func:`step_backend` chooses one for a backend object.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional

import numpy as np

from .timing import is_c_backend

__all__ = ["ModelSteps", "PlanModelSteps", "DecodeRuleSteps", "is_model", "step_backend"]


class _Forwarding:
    """Reads the wrapped model's attributes (weights, config, counters) through the adapter."""

    model: Any

    def __getattr__(self, name):
        if name == "model":
            raise AttributeError(name)
        return getattr(self.model, name)


class ModelSteps(_Forwarding):
    """``execute_step(plan)`` over a model with a per-sequence ``prefill(tokens,
    start_position, block_table) -> next token`` (:class:`qualia.model.PagedModelBackend`): the
    plan's copies first (``copy_pages``), then each request's chunk, through the pages of its
    context (``kv_indices``); the sampled rows get the model's greedy token."""

    def __init__(self, model) -> None:
        self.model = model
        self.steps = 0

    def execute_step(self, plan) -> np.ndarray:
        model = self.model
        if len(plan.copies):
            model.copy_pages(plan.copies)
        qsl = plan.query_start_loc.tolist()
        indptr = plan.kv_indptr.tolist()
        logits = set(plan.logits_indices.tolist())
        ids, pos, pages = plan.input_ids, plan.positions, plan.kv_indices
        out: List[int] = []
        for i in range(len(qsl) - 1):
            a, b = qsl[i], qsl[i + 1]
            token = model.prefill(ids[a:b], int(pos[a]), pages[indptr[i]:indptr[i + 1]])
            if b - 1 in logits:
                out.append(int(token))
        self.steps += 1
        return np.array(out, dtype=np.uint32)


class PlanModelSteps(_Forwarding):
    """``execute_step(plan)`` over a model with the batched step of
    :class:`qualia.model.PagedModelBackend` (``step_logits`` and ``sample``): one forward over
    the plan (its copies first), then one token per sampled row, drawn by the model's keyed
    sampler for ``plan.sampled_request_ids`` (so the members of a group, sampling the same
    logits row, draw apart).  A plan with beam rows (``plan.num_topk > 0``) also gets each
    row's ``num_topk`` most likely ids and their log-probabilities (best first, ties: the lower
    id): ``(ids, topk_ids, topk_logprobs)``, what ``update`` takes."""

    def __init__(self, model) -> None:
        for name in ("step_logits", "sample"):
            if not callable(getattr(model, name, None)):
                raise TypeError(f"{type(model).__name__} has no {name}(): sampling and forks "
                                f"need a model with the batched step of "
                                f"qualia.model.PagedModelBackend")
        self.model = model
        self.steps = 0

    def execute_step(self, plan):
        from ..model.sampling import _topk_of, log_softmax

        model = self.model
        logits = model.step_logits(plan)
        li = np.asarray(plan.logits_indices, dtype=np.int64)
        ids = model.sample(logits, plan.sampled_request_ids,
                           np.asarray(plan.positions, dtype=np.int64)[li] + 1)
        self.steps += 1
        k = int(getattr(plan, "num_topk", 0) or 0)
        if not k:
            return ids
        top_ids, top_lps = _topk_of(log_softmax(logits), k)
        return ids, top_ids, top_lps


class DecodeRuleSteps:
    """``execute_step(plan)`` for a decode rule: each sampled row's token is
    ``rule(request_id, position, token, vocab)`` of the row's last token
    (``qualia.hash_next_token`` by default, the C ``qualia.HashBackend``'s rule; a backend's own
    ``next_token`` for :class:`qualia.twin.PyHashBackend`).  A prefill chunk that samples
    nothing computes nothing: a decode rule keeps no K/V."""

    def __init__(self, vocab: int = 32000,
                 rule: Optional[Callable[[int, int, int, int], int]] = None,
                 backend=None) -> None:
        if rule is None:
            import qualia

            rule = qualia.hash_next_token
        self.backend = backend
        self.rule = rule
        self.vocab = int(vocab)

    def execute_step(self, plan) -> np.ndarray:
        """One step: for each sampled row, the rule's next token of the row's request, position and
        input token (a uint32 array)."""
        rows = np.asarray(plan.logits_indices)
        rule, vocab = self.rule, self.vocab
        rids = np.asarray(plan.sampled_request_ids).tolist()
        pos = np.asarray(plan.positions)[rows].tolist()
        tok = np.asarray(plan.input_ids)[rows].tolist()
        return np.array([rule(r, p, t, vocab) for r, p, t in zip(rids, pos, tok)],
                        dtype=np.uint32)


def is_model(backend) -> bool:
    """Whether ``backend`` is a model (a per-sequence ``prefill``, or weights): its tokens are
    checked against the dense model, and it can sample, fork and rank beams."""
    return (callable(getattr(backend, "prefill", None))
            or getattr(backend, "weights", None) is not None)


def step_backend(backend, *, vocab: int, beams: bool = False, batched: bool = False):
    """``backend`` as an object with ``execute_step(plan)``: a model's batched step for beam
    search (its candidates); the backend itself when it has ``execute_step``; a model's
    per-sequence ``prefill`` (its batched step when ``batched``: sampling, groups); else its
    decode rule (``vocab``: the rule's vocabulary)."""
    if beams and is_model(backend):
        return PlanModelSteps(backend)
    if callable(getattr(backend, "execute_step", None)):
        return backend
    if callable(getattr(backend, "prefill", None)):
        return PlanModelSteps(backend) if batched else ModelSteps(backend)
    rule = getattr(backend, "next_token", None)
    if callable(rule):
        return DecodeRuleSteps(vocab, rule, backend)
    if is_c_backend(backend) and type(backend).__name__ == "HashBackend":
        return DecodeRuleSteps(vocab, backend=backend)
    raise TypeError(f"{type(backend).__name__} is not a step backend: it needs "
                    f"execute_step(plan), a model's prefill(tokens, start, block_table) or "
                    f"a decode rule next_token(request_id, position, token, vocab)")
