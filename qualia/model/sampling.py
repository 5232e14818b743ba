"""Seeded sampling keyed by ``(seed, request id, position)`` and log-probabilities; see
:mod:`qualia.model`."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Tuple

import numpy as np

# --------------------------------------------------------------------------------------------
# sampling and log-probabilities
# --------------------------------------------------------------------------------------------

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def _mix64(x: np.ndarray) -> np.ndarray:
    """The splitmix64 finaliser over a uint64 array (wrapping arithmetic)."""
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _MIX1
    x = (x ^ (x >> np.uint64(27))) * _MIX2
    return x ^ (x >> np.uint64(31))


@dataclass(frozen=True)
class SamplingParams:
    """How a next token is chosen from logits.

    ``temperature == 0`` (the default): greedy, the argmax (ties -> lowest id).  Otherwise one
    draw from ``softmax(logits / temperature)`` restricted to the ``top_k`` most likely ids
    (``0``: all; ties at the cut are all kept), by inverse CDF of ONE uniform number that is a
    pure function of ``(seed, request_id, position)``, where ``position`` is the sequence
    position of the token being sampled.  So a request's tokens do not depend on batching,
    chunking, preemption or on the other requests, and forked children (distinct request ids)
    draw independent streams from the same seed.  However small a positive temperature, the
    draw is among the row's largest logits (whose weights, relative to those, do not
    underflow)."""

    temperature: float = 0.0
    seed: int = 0
    top_k: int = 0

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise ValueError(f"SamplingParams.temperature must be a finite float >= 0, got {t!r}")
        for name, hi in (("seed", 2**64), ("top_k", 2**31)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < hi:
                raise ValueError(f"SamplingParams.{name} must be an int in [0, {hi}), got "
                                 f"{value!r}")

    @property
    def greedy(self) -> bool:
        """Whether the choice is the argmax (``temperature == 0``)."""
        return self.temperature == 0


GREEDY = SamplingParams()


def sampling_uniforms(seed: int, request_ids, positions) -> np.ndarray:
    """The uniform numbers in ``[0, 1)`` that seeded sampling uses for rows ``(request_id,
    position)`` (a splitmix64 hash of ``(seed, request_id, position)``)."""
    rid = np.asarray(request_ids).astype(np.uint64).reshape(-1)
    pos = np.asarray(positions).astype(np.uint64).reshape(-1)
    h = _mix64(np.full(len(rid), seed, dtype=np.uint64))
    h = _mix64(_mix64(h ^ rid) ^ pos)
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / 2**53)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax of ``logits [m, vocab]`` (float64): the model's log-probabilities
    at temperature 1 (what :meth:`PagedModelBackend.execute_step` and :meth:`topk` return)."""
    z = np.asarray(logits, dtype=np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def sample_tokens(logits: np.ndarray, params: SamplingParams, request_ids, positions
                  ) -> np.ndarray:
    """The token ids ``uint32 [m]`` that ``params`` picks from ``logits [m, vocab]`` for rows
    ``(request_ids[i], positions[i])`` (see :class:`SamplingParams`)."""
    logits = np.asarray(logits, dtype=np.float64)
    m, vocab = logits.shape
    if params.greedy or m == 0:
        return np.argmax(logits, axis=-1).astype(np.uint32) if m else np.zeros(0, np.uint32)
    # shifted before the division, so that a temperature however small gives weights in
    # [0, 1] (the row's largest logits weigh 1, the others underflow towards 0), never
    # inf - inf; the same distribution as softmax(logits / temperature)
    with np.errstate(over="ignore"):
        z = (logits - logits.max(axis=-1, keepdims=True)) / params.temperature
    p = np.exp(z)
    if 0 < params.top_k < vocab:
        kth = np.partition(z, vocab - params.top_k, axis=-1)[:, vocab - params.top_k]
        p = np.where(z >= kth[:, None], p, 0.0)
    cdf = np.cumsum(p, axis=-1)  # sequential: the same numbers whatever the batch
    target = sampling_uniforms(params.seed, request_ids, positions) * cdf[:, -1]
    idx = (cdf <= target[:, None]).sum(axis=-1)  # first id whose cdf passes the target
    last = vocab - 1 - np.argmax(p[:, ::-1] > 0, axis=-1)  # (rounding guard)
    return np.minimum(idx, last).astype(np.uint32)


def _topk_of(logprobs: np.ndarray, k: int) -> Tuple[np.ndarray, np.ndarray]:
    order = np.argsort(-logprobs, axis=-1, kind="stable")[:, :k]  # ties -> lower id first
    return order.astype(np.uint32), np.take_along_axis(logprobs, order, axis=-1)


