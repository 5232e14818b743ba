# cython: language_level=3
# The compiled core of qualia, one extension module built from one source file per concept.
#
# The hot paths inline pool -> table -> cache calls, so the concepts are joined into
# one module with `include` (as uvloop does) rather than split into modules that would call each
# other through Python-visible boundaries.  Nothing here is exported to C: the public C surface is
# the backend ABI in csrc/qualia.h (mirrored by qualia/_abi.pxd).
#
# Every operation is a `noexcept nogil` C function returning a status code (Q_OK or the code of
# one error variant), wrapped by a thin `def` that resolves every Python argument first (anything
# that can run user code), then takes ownership of every object it touches
# (core/base/ownership.pxi), mutates, releases, and maps a failing code to an exception through the
# one table in core/base/errors.pxi.  State memory is allocated in __cinit__; the steady-state
# operations allocate nothing.  The GIL is released around calls into C backends, while the core's
# state is owned and the core does not touch it, and around the loop of StepScheduler.run() with a
# C step backend, which owns the state and changes it: every other call, reads included, is
# refused meanwhile, except draining the KV event ring (a single-producer, single-consumer ring).
#
# Where each concept lives (one folder per family, each file with its declarations):
#   core/base/      structs.pxi (status codes, C declarations), abi.pxi (numpy dtypes from the
#                   compiled ABI), args.pxi (arguments, buffers, views), errors.pxi (status code
#                   -> exception, one table), ownership.pxi (who may mutate an object, and when)
#   core/pages/     pool.pxi (block pool), table.pxi (block table, copy-on-write, undo log),
#                   fork.pxi (copy-on-write forks of a decoding request)
#   core/cache/     identity.pxi (prefix identity, token resolution), index.pxi (open addressing,
#                   the id indexes), store.pxi (prefix KV store), pagecache.pxi (automatic prefix
#                   caching: the page cache, its hash, namespaces, events), autoprefix.pxi (token
#                   streams; admit / fill / finish / reclaim), reads.pxi (the cache's reads, the
#                   caching options), router.pxi (the router's index)
#   core/backends/  backends.pxi: backend resolution (rounds and steps), receipts, the lowering of
#                   a Python plan, the built-in hash backend
#   core/seed/      requests.pxi (the seed's RequestScheduler and its decode round), reserve.pxi
#                   (page reservation, shared with the step), facade.pxi (qualia.Scheduler)
#   core/step/      the engine step, qualia.StepScheduler: requests.pxi (entries, the id index,
#                   add / abort / collect), arena.pxi (token arena), queue.pxi (waiting heap),
#                   running.pxi (running set, rows, preemption), copies.pxi (copy-on-write
#                   copies owed until applied), groups.pxi (n groups), beams.pxi
#                   (beam groups, selection, hypotheses), plan.pxi (plan state, buffers, lowering,
#                   StepPlan), schedule.pxi, update.pxi, loop.pxi (run()'s GIL-free loop),
#                   state.pxi (StepState composed, allocation), scheduler.pxi (the class)

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

cimport cython
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
include "core/seed/reserve.pxi"
include "core/pages/fork.pxi"
include "core/step/requests.pxi"
include "core/step/arena.pxi"
include "core/step/queue.pxi"
include "core/step/running.pxi"
include "core/step/copies.pxi"
include "core/step/groups.pxi"
include "core/step/beams.pxi"
include "core/step/plan.pxi"
include "core/step/schedule.pxi"
include "core/step/update.pxi"
include "core/step/loop.pxi"
include "core/step/state.pxi"
include "core/step/scheduler.pxi"
include "core/seed/facade.pxi"
include "core/cache/router.pxi"
