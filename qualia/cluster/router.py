"""The router's choice of a replica for a request (see :mod:`qualia.cluster`).

Policies: ``prefix`` sends a request to the replica holding the longest run of its leading pages,
less a load cost (``load_weight`` pages per request queued there); ``round-robin`` and
``least-loaded`` ignore the caches.  The replicas' KV events feed the index
(:class:`qualia.PrefixRouterIndex`, in the compiled core): page identity -> replicas holding it.
"""

from __future__ import annotations

import decimal
import math
import numbers
from typing import Any, List, Optional, Sequence, Tuple

import numpy as np

import qualia

from .replica import ReplicaConfig

__all__ = ["POLICIES", "Router"]

POLICIES = ("prefix", "round-robin", "least-loaded")


def is_real_number(value: Any) -> bool:
    """Whether ``value`` is a real number: an ``int``, a ``float``, a numpy number, a
    ``fractions.Fraction`` or a ``decimal.Decimal``; not a bool."""
    return (isinstance(value, (numbers.Real, decimal.Decimal))
            and not isinstance(value, (bool, np.bool_)))


def real_number(name: str, value: Any) -> float:
    """``value`` as a ``float``: a real number (:func:`is_real_number`), else ``TypeError``
    naming ``name`` (a string, a bool, None ...).  One too large for a float is ``inf`` and a
    signaling NaN is ``nan``: the caller's range check refuses them."""
    if not is_real_number(value):
        raise TypeError(f"{name} must be a number, got {value!r}")
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf
    except ValueError:   # decimal.Decimal("sNaN")
        return math.nan


def checked_load_weight(value: Any) -> float:
    """``value`` as the prefix policy's ``load_weight``: a finite real number >= 0 (pages per
    request queued; any real number, converted with ``float``), else ``ValueError``
    (``TypeError`` for what is not a real number)."""
    weight = real_number("load_weight", value)
    if not 0.0 <= weight < math.inf:
        raise ValueError(f"load_weight must be a finite number >= 0, got {value!r}")
    return weight


def checked_step_timeout(value: Any) -> float:
    """``value`` as a cluster's ``step_timeout``: a finite real number of seconds > 0 (any
    real number, converted with ``float``), else ``ValueError`` (``TypeError`` for what is not
    a real number)."""
    seconds = real_number("step_timeout", value)
    if not 0.0 < seconds < math.inf:
        raise ValueError(f"step_timeout must be a finite number of seconds > 0, got {value!r}")
    return seconds


class Router:
    """The routing state of ``replicas`` replicas built with ``config``: which are live, their
    load (running + waiting at their last report + routed since), the prefix index, and the
    round-robin turn."""

    def __init__(self, replicas: int, policy: str, config: ReplicaConfig, *,
                 load_weight: float = 0.25, index_capacity: Optional[int] = None) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {policy!r}")
        self.n = int(replicas)
        self.policy = policy
        self.config = config
        self.load_weight = checked_load_weight(load_weight)
        self.index = qualia.PrefixRouterIndex(
            index_capacity if index_capacity is not None else 2 * self.n * config.num_pages + 64,
            self.n)
        # the router computes page identities with the replicas' cache key
        self._ident = qualia.Scheduler(1, 1, config.page_tokens, 1, cache_key=config.cache_key)
        self._match = np.zeros(self.n, dtype=np.uint32)
        self.live: List[bool] = [True] * self.n
        self.load: List[int] = [0] * self.n
        self.rr = 0

    def page_identities(self, prompt: Sequence[int], namespace: bytes = b"") -> np.ndarray:
        """The page identities of ``prompt``'s full pages, as the replicas' caches compute
        them (the same cache key)."""
        return self._ident.page_identities(np.asarray(prompt, dtype=np.uint32), namespace)

    def _eligible(self, r: int) -> bool:
        return self.live[r] and self.load[r] < self.config.queue_limit

    def route(self, prompt: Sequence[int], namespace: bytes = b"") -> Tuple[int, int]:
        """The replica for a request (-1 when none can take it now) and the pages of its prompt
        the chosen replica holds (prefix policy; 0 otherwise)."""
        n = self.n
        if self.policy == "round-robin":
            for k in range(n):
                r = (self.rr + k) % n
                if self._eligible(r):
                    self.rr = (r + 1) % n
                    return r, 0
            return -1, 0
        if self.policy == "least-loaded":
            best = -1
            for r in range(n):
                if self._eligible(r) and (best < 0 or self.load[r] < self.load[best]):
                    best = r
            return best, 0
        ids = self.page_identities(prompt, namespace)
        low = min((self.load[r] for r in range(n) if self._eligible(r)), default=0)
        cost = np.array([self.load_weight * (self.load[r] - low) if self._eligible(r)
                         else math.inf for r in range(n)])
        r = self.index.route(ids, cost, self._match)
        return r, (int(self._match[r]) if r >= 0 else 0)

