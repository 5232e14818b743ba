# cython: language_level=3
# The compiled core of qualia, one extension module built from one source file per concept.
#
# The facade's hot path inlines pool, table and scheduler calls, so the concepts are joined into
# one module with `include` (as uvloop does) rather than split into modules that would call each
# other through Python-visible boundaries.  Nothing here is exported to C: the public C surface is
# the backend ABI in csrc/qualia.h (mirrored by qualia/_abi.pxd).
#
# Every operation is a `noexcept nogil` C function returning a status code (Q_OK or the code of
# one error variant), wrapped by a thin `def` that resolves every Python argument first (anything
# that can run user code), then takes ownership of every object it touches (core/ownership.pxi),
# mutates, releases, and maps a failing code to an exception through the one table in
# core/errors.pxi.  State memory is allocated in __cinit__; the steady-state operations allocate
# nothing.  The GIL is released around calls into C backends, while the core's state is owned and
# the core does not touch it, and around the loop of Scheduler.run() with a C step backend, which
# owns the state and changes it: every other call, reads included, is refused meanwhile, except
# draining the KV event ring (a single-producer, single-consumer ring).
#
# Where each concept lives:
#   core/structs.pxi     C structs, status codes, C declarations
#   core/abi.pxi         numpy dtypes derived from the compiled ABI structs
#   core/args.pxi        argument resolution: integers, the one buffer validator, views
#   core/errors.pxi      status code -> exception class, one table
#   core/ownership.pxi   the ownership rule (who may mutate an object, and when)
#   core/pool.pxi        block pool
#   core/table.pxi       sequence block table and copy-on-write
#   core/identity.pxi    prefix identity and token hashing
#   core/index.pxi       open addressing shared by the store and request indexes
#   core/store.pxi       prefix KV store
#   core/backends.pxi    backend resolution (rounds and steps), receipts, step-plan lowering,
#                        the built-in hash backend
#   core/requests.pxi    the seed's request scheduler and its decode round
#   core/pagecache.pxi   automatic prefix caching: the page cache, its hash, namespaces, events
#   core/autoprefix.pxi  automatic prefix caching: the facade's token streams, admit/fill/finish
#   core/step.pxi        the engine step: request queue, token arena, schedule / update in C
#   core/facade.pxi      qualia.Scheduler: admit / reserve / decode / finish, and the step API
#   core/router.pxi      the router's index: page identity -> replicas holding it (KV events)

from cpython.buffer cimport (PyObject_GetBuffer, PyBuffer_Release, PyBUF_STRIDES, PyBUF_FORMAT,
                             PyBUF_WRITABLE, PyBUF_ND)
from cpython.bytes cimport PyBytes_FromStringAndSize
from cpython.exc cimport PyErr_CheckSignals, PyErr_Occurred, PyErr_Clear
from cpython.long cimport PyLong_CheckExact
from cpython.mem cimport PyMem_Malloc, PyMem_Calloc, PyMem_Free, PyMem_Realloc
from cpython.ref cimport Py_INCREF, Py_DECREF
from cpython.pycapsule cimport (PyCapsule_New, PyCapsule_CheckExact, PyCapsule_GetName,
                                PyCapsule_GetPointer, PyCapsule_GetContext, PyCapsule_SetContext)
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t, int32_t, int64_t, uintptr_t
from libc.string cimport memcmp, memcpy, memmove, memset, strcmp

from qualia._abi cimport *

import operator
import os
import re as _re
from itertools import islice as _islice
from collections.abc import Sequence as _AbcSequence

import numpy as np

cimport numpy as cnp

cnp.import_array()

from qualia._types import (Admission, CacheEntry, CachedPrefix, CacheStats, CopyOnWrite,
                           RaggedBatchReceipt, RequestState, FinishedRequest, FinishedGroup,
                           RunResult,
                           RUN_STATS_ROWS, STEP_STATS, STEP_TOTALS)
from qualia.errors import (BackendAbiError, BusyError, DecodeRoundError, PoolError,
                           PrefixCacheError, PrefixKvError, RaggedBackendError,
                           SchedulerError, StepError, TableError)

include "core/base/structs.pxi"
include "core/base/abi.pxi"
include "core/base/args.pxi"
include "core/base/errors.pxi"
include "core/base/ownership.pxi"
include "core/pages/pool.pxi"
include "core/pages/table.pxi"
include "core/cache/identity.pxi"
include "core/cache/index.pxi"
include "core/cache/store.pxi"
include "core/backends/backends.pxi"
include "core/seed/requests.pxi"
include "core/cache/pagecache.pxi"
include "core/cache/autoprefix.pxi"
include "core/cache/reads.pxi"
include "core/pages/fork.pxi"
include "core/step/step.pxi"
include "core/step/scheduler.pxi"
include "core/seed/facade.pxi"
include "core/cache/router.pxi"
