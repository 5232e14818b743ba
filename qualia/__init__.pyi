"""Type stubs of the package's public names (the compiled core's are in _core.pyi)."""

from . import errors as errors
from ._core import BACKEND_ABI_VERSION as BACKEND_ABI_VERSION
from ._core import BACKEND_CAPSULE_NAME as BACKEND_CAPSULE_NAME
from ._core import COPY_OP as COPY_OP
from ._core import KV_EVENT as KV_EVENT
from ._core import MAX_STOP_TOKENS as MAX_STOP_TOKENS
from ._core import RAGGED_BATCH_ITEM as RAGGED_BATCH_ITEM
from ._core import RAGGED_BATCH_OUTPUT as RAGGED_BATCH_OUTPUT
from ._core import RAGGED_BATCH_RECEIPT as RAGGED_BATCH_RECEIPT
from ._core import REQUEST_VIEW as REQUEST_VIEW
from ._core import STEP_ABI_VERSION as STEP_ABI_VERSION
from ._core import STEP_CAPSULE_NAME as STEP_CAPSULE_NAME
from ._core import BlockPool as BlockPool
from ._core import HashBackend as HashBackend
from ._core import PrefixIdentity as PrefixIdentity
from ._core import PrefixKvStore as PrefixKvStore
from ._core import PrefixRouterIndex as PrefixRouterIndex
from ._core import RequestScheduler as RequestScheduler
from ._core import Scheduler as Scheduler
from ._core import SequenceBlockTable as SequenceBlockTable
from ._core import StepPlan as StepPlan
from ._core import StepScheduler as StepScheduler
from ._core import hash_logprob as hash_logprob
from ._core import hash_next_token as hash_next_token
from ._types import RUN_STATS_ROWS as RUN_STATS_ROWS
from ._types import STEP_STATS as STEP_STATS
from ._types import STEP_TOTALS as STEP_TOTALS
from ._types import Admission as Admission
from ._types import CachedPrefix as CachedPrefix
from ._types import CacheEntry as CacheEntry
from ._types import CacheStats as CacheStats
from ._types import CopyOnWrite as CopyOnWrite
from ._types import FinishedGroup as FinishedGroup
from ._types import FinishedRequest as FinishedRequest
from ._types import RaggedBatchReceipt as RaggedBatchReceipt
from ._types import RequestState as RequestState
from ._types import RunResult as RunResult
from .backend import CopyPagesBackend as CopyPagesBackend
from .backend import RaggedBackend as RaggedBackend
from .errors import BackendAbiError as BackendAbiError
from .errors import BusyError as BusyError
from .errors import DecodeRoundError as DecodeRoundError
from .errors import PoolError as PoolError
from .errors import PrefixCacheError as PrefixCacheError
from .errors import PrefixKvError as PrefixKvError
from .errors import QualiaError as QualiaError
from .errors import RaggedBackendError as RaggedBackendError
from .errors import SchedulerError as SchedulerError
from .errors import StepError as StepError
from .errors import TableError as TableError

__version__: str
__all__ = [
    "Admission",
    "BACKEND_ABI_VERSION",
    "BACKEND_CAPSULE_NAME",
    "BackendAbiError",
    "BlockPool",
    "BusyError",
    "CachedPrefix",
    "CacheEntry",
    "CacheStats",
    "COPY_OP",
    "CopyOnWrite",
    "CopyPagesBackend",
    "DecodeRoundError",
    "errors",
    "get_include",
    "hash_logprob",
    "hash_next_token",
    "HashBackend",
    "KV_EVENT",
    "PoolError",
    "PrefixCacheError",
    "StepError",
    "PrefixIdentity",
    "PrefixKvError",
    "PrefixKvStore",
    "PrefixRouterIndex",
    "QualiaError",
    "RAGGED_BATCH_ITEM",
    "RAGGED_BATCH_OUTPUT",
    "RAGGED_BATCH_RECEIPT",
    "RaggedBackend",
    "RaggedBackendError",
    "RaggedBatchReceipt",
    "REQUEST_VIEW",
    "RequestScheduler",
    "RequestState",
    "Scheduler",
    "SchedulerError",
    "SequenceBlockTable",
    "STEP_ABI_VERSION",
    "STEP_CAPSULE_NAME",
    "TableError",
    "StepPlan",
    "StepScheduler",
    "FinishedRequest",
    "FinishedGroup",
    "RunResult",
    "STEP_STATS",
    "STEP_TOTALS",
    "RUN_STATS_ROWS",
    "MAX_STOP_TOKENS",
]

def get_include() -> str: ...
