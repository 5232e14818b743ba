"""Data-parallel replicas on Ray behind a prefix-aware router (docs/DESIGN.md, "Replicas and the
prefix router").

Each replica is one engine: a step scheduler (``add_request`` / ``schedule`` / ``update``) and a
step backend, run as a Ray actor (:class:`Replica`; in-process with ``local=True``).  The router
(:class:`Cluster`) drives every replica one engine step at a time: each call hands the replica
the requests routed to it since its last step, runs one step, and brings back what happened --
the tokens sampled, the requests finished, the KV events its automatic prefix cache emitted and
its load (running, waiting, free pages).  The events feed the router's index
(:class:`qualia.PrefixRouterIndex`, in the compiled core): page identity -> replicas holding it.

Policies: ``prefix`` sends a request to the replica holding the longest run of its leading pages,
less a load cost (``load_weight`` pages per request queued there); ``round-robin`` and
``least-loaded`` ignore the caches.

Faults: a replica whose step call fails (its actor died) is marked down, taken off the index, and
its unfinished requests go back to the router's queue, resubmitted to the survivors with the
tokens generated so far appended to the prompt (the backend is deterministic, so recomputing
gives the same tokens).  The router records each request's completion once; a replica that is
restarted (``rejoin_after`` steps later) rejoins with an empty cache.

Only this module needs Ray (the ``cluster`` extra: ``pip install ".[cluster]"`` in the qualia
checkout): it is imported lazily, and ``local=True`` runs the same code in one process without
it.
"""

from ..sim.adapters import DecodeRuleSteps as HashStepBackend  # the replicas' hash rule
from .cluster import Cluster, ClusterResult, compare_policies, format_comparison, init_local_ray
from .metrics import ClusterMetrics
from .replica import Replica, ReplicaConfig, make_scheduler, model_weights
from .router import POLICIES, Router

__all__ = ["POLICIES", "ReplicaConfig", "Replica", "Router", "Cluster", "ClusterResult",
           "ClusterMetrics", "init_local_ray", "make_scheduler",
           "model_weights", "compare_policies", "format_comparison", "HashStepBackend",
           "add_cluster_options", "wants_cluster", "simulate_cli"]

_COMMAND_LINE = ("add_cluster_options", "wants_cluster", "simulate_cli")


def __getattr__(name: str):
    """The ``--replicas`` command line's functions, from :mod:`qualia.cli.cluster` (which
    imports this package)."""
    if name in _COMMAND_LINE:
        from ..cli import cluster as command_line

        return getattr(command_line, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
