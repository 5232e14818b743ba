"""qualia: an LLM-serving request scheduler core in Cython over C structs.

The compiled core (`qualia._core`) holds the paged KV block pool, copy-on-write block tables, the
prefix KV store and the seed's request scheduler; `qualia.StepScheduler` is the engine step
(add_request / schedule / update / run) and `qualia.Scheduler` the admit/decode/finish facade over
the seed's types.  `qualia.twin` is the same semantics in plain Python.
"""

import os as _os

from . import errors

try:
    from ._core import (
        BACKEND_ABI_VERSION,
        BACKEND_CAPSULE_NAME,
        COPY_OP,
        KV_EVENT,
        MAX_STOP_TOKENS,
        RAGGED_BATCH_ITEM,
        RAGGED_BATCH_OUTPUT,
        RAGGED_BATCH_RECEIPT,
        REQUEST_VIEW,
        STEP_ABI_VERSION,
        STEP_CAPSULE_NAME,
        BlockPool,
        HashBackend,
        PrefixIdentity,
        PrefixKvStore,
        PrefixRouterIndex,
        RequestScheduler,
        Scheduler,
        SequenceBlockTable,
        StepPlan,
        StepScheduler,
        hash_logprob,
        hash_next_token,
    )
except ImportError as _exc:
    from ._source_tree import explain_missing_core as _explain

    _why = _explain(__name__, _os.path.dirname(_os.path.abspath(__file__)))
    if _why is None:  # the compiled core is there but failed to load: show the real reason
        raise
    raise ImportError(_why, name=__name__) from _exc
from ._types import (
    RUN_STATS_ROWS,
    STEP_STATS,
    STEP_TOTALS,
    Admission,
    CachedPrefix,
    CacheEntry,
    CacheStats,
    CopyOnWrite,
    FinishedGroup,
    FinishedRequest,
    RaggedBatchReceipt,
    RequestState,
    RunResult,
)
from .backend import CopyPagesBackend, RaggedBackend
from .errors import (
    BackendAbiError,
    BusyError,
    DecodeRoundError,
    PoolError,
    PrefixCacheError,
    PrefixKvError,
    QualiaError,
    RaggedBackendError,
    SchedulerError,
    StepError,
    TableError,
)

__version__ = "0.1.0"


def get_include() -> str:
    """The folder holding ``qualia.h`` (the C ABI) for C/C++/Cython backends."""
    return _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "include")


__all__ = [
    "Admission", "BACKEND_ABI_VERSION", "BACKEND_CAPSULE_NAME", "BackendAbiError", "BlockPool",
    "BusyError", "CachedPrefix", "CacheEntry", "CacheStats", "COPY_OP", "CopyOnWrite",
    "CopyPagesBackend", "DecodeRoundError", "errors", "get_include", "hash_logprob",
    "hash_next_token",
    "HashBackend", "KV_EVENT", "PoolError", "PrefixCacheError", "PrefixIdentity", "PrefixKvError",
    "PrefixKvStore", "PrefixRouterIndex", "QualiaError", "RAGGED_BATCH_ITEM", "RAGGED_BATCH_OUTPUT",
    "RAGGED_BATCH_RECEIPT", "RaggedBackend", "RaggedBackendError", "RaggedBatchReceipt",
    "REQUEST_VIEW", "RequestScheduler", "RequestState", "Scheduler", "SchedulerError",
    "SequenceBlockTable", "STEP_ABI_VERSION", "STEP_CAPSULE_NAME", "StepError", "TableError",
    "StepPlan", "StepScheduler", "FinishedRequest", "FinishedGroup", "RunResult", "STEP_STATS",
    "MAX_STOP_TOKENS", "STEP_TOTALS", "RUN_STATS_ROWS",
]
