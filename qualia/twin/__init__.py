"""The pure-Python twin of the compiled core: the same semantics in plain Python, the executable
spec the core is checked against plan for plan (docs/DESIGN.md, "The twin").

* :mod:`qualia.twin.seed`: the seed's types (pool, block table, prefix store, request scheduler)
  and :class:`PyHashBackend`;
* :mod:`qualia.twin.cache`: :class:`Scheduler`, the admit/decode/finish facade with its page
  cache;
* :mod:`qualia.twin.step`: :class:`StepScheduler`, the engine step over that facade.
"""

from .cache import Scheduler
from .fork import ForkStepPlan, ForkStepScheduler
from .seed import (
    COPY_OP,
    RAGGED_BATCH_ITEM,
    RAGGED_BATCH_OUTPUT,
    RAGGED_BATCH_RECEIPT,
    REQUEST_VIEW,
    U32_MAX,
    U64_MAX,
    BlockPool,
    PrefixIdentity,
    PrefixKvStore,
    PyHashBackend,
    RequestScheduler,
    SequenceBlockTable,
)
from .step import StepPlan, StepScheduler

__all__ = [
    "BlockPool",
    "SequenceBlockTable",
    "PrefixIdentity",
    "PrefixKvStore",
    "RequestScheduler",
    "PyHashBackend",
    "RAGGED_BATCH_ITEM",
    "RAGGED_BATCH_OUTPUT",
    "RAGGED_BATCH_RECEIPT",
    "REQUEST_VIEW",
    "COPY_OP",
    "U32_MAX",
    "U64_MAX",
    "Scheduler",
    "StepScheduler",
    "StepPlan",
    "ForkStepScheduler",
    "ForkStepPlan",
]
