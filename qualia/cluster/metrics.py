"""Prometheus metrics of the replicas and the router (see :mod:`qualia.cluster`)."""

from __future__ import annotations

from typing import Any, Tuple

__all__ = ["ClusterMetrics"]

_REPLICA = ("replica",)

# ClusterMetrics' metrics: (attribute, Gauge or Counter, metric name, help text, labels)
_METRICS: Tuple[Tuple[str, str, str, str, Tuple[str, ...]], ...] = (
    ("up", "Gauge", "qualia_replica_up", "1 while the replica is live", _REPLICA),
    ("running", "Gauge", "qualia_replica_requests_running", "requests running", _REPLICA),
    ("waiting", "Gauge", "qualia_replica_requests_waiting", "requests waiting", _REPLICA),
    ("pool", "Gauge", "qualia_replica_pool_usage", "fraction of KV pages not free", _REPLICA),
    ("hit_rate", "Gauge", "qualia_replica_cache_hit_rate",
     "prompt tokens found in the prefix cache / prompt tokens looked up", _REPLICA),
    ("cached", "Counter", "qualia_replica_cached_tokens", "prompt tokens the cache skipped",
     _REPLICA),
    ("prefill", "Counter", "qualia_replica_prefill_tokens", "prefill tokens computed", _REPLICA),
    ("generated", "Counter", "qualia_replica_generated_tokens", "tokens sampled", _REPLICA),
    ("preemptions", "Counter", "qualia_replica_preemptions", "requests preempted", _REPLICA),
    ("decisions", "Counter", "qualia_router_decisions", "routing decisions",
     ("policy", "replica")),
    ("resubmitted", "Counter", "qualia_router_resubmitted",
     "requests resubmitted after their replica died", ()),
    ("deaths", "Counter", "qualia_router_replica_deaths", "replicas found dead", ()),
    ("completed", "Counter", "qualia_router_requests_completed", "requests completed", ()),
    ("identities", "Gauge", "qualia_router_index_identities",
     "page identities in the router's index", ()),
    ("router_hit", "Gauge", "qualia_router_cache_hit_rate",
     "prompt tokens found in the prefix caches / prompt tokens looked up, every replica", ()),
)


class ClusterMetrics:
    """Prometheus metrics of the replicas (labelled ``replica``, from what each reports every
    step) and of the router, in a registry of their own; :meth:`serve` exposes them over HTTP
    (the exposition format) on ``port``.  One attribute a metric, declared in ``_METRICS``."""

    up: Any
    """``qualia_replica_up``: 1 while the replica is live."""
    running: Any
    """``qualia_replica_requests_running``: requests running."""
    waiting: Any
    """``qualia_replica_requests_waiting``: requests waiting."""
    pool: Any
    """``qualia_replica_pool_usage``: the fraction of KV pages not free."""
    hit_rate: Any
    """``qualia_replica_cache_hit_rate``: prompt tokens found in the prefix cache over prompt tokens
    looked up."""
    cached: Any
    """``qualia_replica_cached_tokens_total``: prompt tokens the cache skipped."""
    prefill: Any
    """``qualia_replica_prefill_tokens_total``: prefill tokens computed."""
    generated: Any
    """``qualia_replica_generated_tokens_total``: tokens sampled."""
    preemptions: Any
    """``qualia_replica_preemptions_total``: requests preempted."""
    decisions: Any
    """``qualia_router_decisions_total{policy, replica}``: routing decisions."""
    resubmitted: Any
    """``qualia_router_resubmitted_total``: requests resubmitted after their replica died."""
    deaths: Any
    """``qualia_router_replica_deaths_total``: replicas found dead."""
    completed: Any
    """``qualia_router_requests_completed_total``: requests completed."""
    identities: Any
    """``qualia_router_index_identities``: page identities in the router's index."""
    router_hit: Any
    """``qualia_router_cache_hit_rate``: prompt tokens found in the prefix caches over those looked
    up, every replica."""

    def __init__(self) -> None:
        import prometheus_client
        self.registry = prometheus_client.CollectorRegistry()
        for attr, kind, name, help_text, labels in _METRICS:
            setattr(self, attr, getattr(prometheus_client, kind)(name, help_text, labels,
                                                                 registry=self.registry))
        self._server: Any = None

    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve the metrics on ``addr:port`` (0: any free port); returns the port."""
        from prometheus_client import start_http_server
        started = start_http_server(port, addr=addr, registry=self.registry)
        self._server = started[0] if isinstance(started, tuple) else None
        return self._server.server_port if self._server is not None else port

    def close(self) -> None:
        """Stop serving the metrics (if :meth:`serve` started a server)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
