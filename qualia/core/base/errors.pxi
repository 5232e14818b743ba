# Status codes -> exception classes: one table, built and checked when the module is imported.
#
# A nogil operation returns Q_OK or the code of one variant (core/base/structs.pxi).  The same code
# surfaces differently depending on the layer that called: a pool's Exhausted is
# PoolError.Exhausted from BlockPool.allocate, TableError.Exhausted from ensure_writable (pool
# errors met by a table are flattened into it), SchedulerError.Table(TableError.Exhausted) from
# the request scheduler, and so on.  _ERRORS[layer][code] is the chain of classes, outermost
# first, for every code a layer can return; every name is looked up in qualia.errors at import,
# so a mismatch between the codes and the error classes fails the import, not an error path.

cdef enum:
    E_POOL = 0      # BlockPool
    E_TABLE = 1     # SequenceBlockTable
    E_STORE = 2     # PrefixKvStore.publish / evict (pool errors wrapped as PrefixKvError.Pool)
    E_ATTACH = 3    # PrefixKvStore.attach (table errors wrapped as PrefixKvError.Table)
    E_SCHED = 4     # RequestScheduler (table errors wrapped as SchedulerError.Table)
    E_ADMIT = 5     # admission: a prefix attach failure is SchedulerError.Prefix(...)
    # E_DECODE, the facade's decode: DecodeRoundError.Scheduler(SchedulerError.Table(...)), and
    # the round's own DecodeRoundError variants
    E_DECODE = 6
    E_ROUND = 7     # RequestScheduler.execute_decode_round: the round's DecodeRoundError variants
    # E_AUTO, automatic prefix caching's admission: SchedulerError, SchedulerError.Table,
    # PrefixCacheError
    E_AUTO = 8
    # E_STEP, the engine step: StepError, and what its admissions and reservations meet
    # (SchedulerError, SchedulerError.Table, PrefixCacheError)
    E_STEP = 9
    E_LAYERS = 10

# code -> variant name (Q_STORE_FULL and Q_FULL are both "Full", in different families)
cdef tuple _CODE_NAMES = (None, "Exhausted", "InvalidPage", "NotAllocated", "Overflow",
                          "OutOfRange", "Gap", "NotEmpty",
                          "EmptyPrefix", "TooManyPages", "Duplicate", "Full", "Unknown",
                          "DuplicateRequest", "Full", "UnknownRequest", "OutputTooSmall",
                          "ItemBufferTooSmall", "OutputBufferTooSmall", "BlockTableBufferTooSmall",
                          "MissingInputToken", "OutputIdentityMismatch", "BackendLaunchCount",
                          None, "NamespaceTableFull", "DuplicateRequest", "UnknownRequest",
                          "NeverFits", "QueueFull", "PlanPending", "NoPlan", "ForkInPrefill",
                          None, None, None, None, None, None, None, None, None)


def _error_table():
    pool_codes = range(Q_EXHAUSTED, Q_OVERFLOW + 1)
    table_codes = range(Q_EXHAUSTED, Q_NOT_EMPTY + 1)
    store_codes = range(Q_EMPTY_PREFIX, Q_UNKNOWN + 1)
    sched_codes = range(Q_DUPLICATE_REQUEST, Q_OUTPUT_TOO_SMALL + 1)
    round_codes = range(Q_ITEM_BUFFER_TOO_SMALL, Q_BACKEND_LAUNCH_COUNT + 1)
    cache_codes = range(Q_NAMESPACES_FULL, Q_NAMESPACES_FULL + 1)
    fork_codes = range(Q_FORK_IN_PREFILL, Q_FORK_IN_PREFILL + 1)
    step_codes = range(Q_STEP_DUPLICATE, Q_NO_PLAN + 1)
    # layer -> [(codes, wrappers outermost first, family of the leaf)]
    rules = {
        E_POOL: [(pool_codes, (), PoolError)],
        E_TABLE: [(table_codes, (), TableError)],
        E_STORE: [(store_codes, (), PrefixKvError),
                  (pool_codes, (PrefixKvError.Pool,), PoolError)],
        E_ATTACH: [(table_codes, (PrefixKvError.Table,), TableError)],
        E_SCHED: [(sched_codes, (), SchedulerError),
                  (fork_codes, (), SchedulerError),
                  (table_codes, (SchedulerError.Table,), TableError)],
        E_ADMIT: [(sched_codes, (), SchedulerError),
                  (table_codes, (SchedulerError.Prefix, PrefixKvError.Table), TableError)],
        E_DECODE: [(table_codes, (DecodeRoundError.Scheduler, SchedulerError.Table), TableError),
                   (round_codes, (), DecodeRoundError)],
        E_ROUND: [(round_codes, (), DecodeRoundError)],
        E_AUTO: [(sched_codes, (), SchedulerError),
                 (table_codes, (SchedulerError.Table,), TableError),
                 (cache_codes, (), PrefixCacheError)],
        E_STEP: [(step_codes, (), StepError),
                 (sched_codes, (), SchedulerError),
                 (table_codes, (SchedulerError.Table,), TableError),
                 (cache_codes, (), PrefixCacheError)],
    }
    if len(_CODE_NAMES) != Q_CODES:
        raise ImportError("the status codes and their names differ in number")
    table = []
    for layer in range(E_LAYERS):
        row = [None] * len(_CODE_NAMES)
        for codes, wrappers, family in rules[layer]:
            for code in codes:
                leaf = getattr(family, _CODE_NAMES[code])  # AttributeError here = a bad table
                if not (isinstance(leaf, type) and issubclass(leaf, family)):
                    raise ImportError(f"qualia.errors has no variant {family.__name__}."
                                      f"{_CODE_NAMES[code]}")
                row[code] = tuple(wrappers) + (leaf,)
        table.append(tuple(row))
    return tuple(table)


cdef tuple _ERRORS = _error_table()


# Codes that are no variant of a family, whatever the layer: a built-in exception with a message
# ({row}: the row that failed, {token}: its token id, {limit}: the largest id of the
# vocabulary), or, with no message, RaggedBackendError.Failed of the backend's own status.
# the plan buffers by PB_* (core/base/structs.pxi), as a Q_PLAN_OVERRUN names them
cdef tuple _PLAN_BUFFER_NAMES = ("per-request", "per-token", "sampled-row", "kv_indices",
                                 "copies", "new_request_ids", "preempted_request_ids",
                                 "finished_request_ids", "fork id")


cdef dict _PLAIN = {
    Q_ROUND_TOO_LARGE: (OverflowError, "the lowered block table exceeds 2**32-1 entries"),
    Q_RUN_BACKEND_FAILED: (RaggedBackendError.Failed, None),
    Q_RUN_UNWRITTEN: (ValueError, "the step backend returned 0 without writing sampled row {row} "
                                  "(or wrote 4294967295, which is no token id); the step was "
                                  "discarded"),
    Q_RUN_BAD_TOKEN: (ValueError, "the step backend sampled token id {token} (row {row}), "
                                  "outside [0, {limit}]"),
    Q_RUN_NO_TOPK: (TypeError, "the plan has beam rows (num_topk > 0) and the C step backend "
                               "does not declare QUALIA_STEP_WRITES_TOPK; the step was discarded"),
    Q_RUN_BAD_TOPK: (ValueError, "the step backend wrote a candidate token id outside "
                                 "[0, {limit}] (row {row})"),
    Q_RUN_BAD_TOPK_LOGPROB: (ValueError, "the step backend wrote a candidate log-probability "
                                         "that is NaN or above 0 (a log-probability is at most "
                                         "0), or left it unwritten (row {row})"),
    Q_RUN_REPEATED_TOPK: (ValueError, "the step backend repeated a token among a beam's "
                                      "candidates (row {row})"),
    Q_RUN_UNSORTED_TOPK: (ValueError, "the step backend wrote a beam row's candidates out of "
                                      "order: not best first (row {row})"),
    Q_PLAN_OVERRUN: (SystemError, "qualia internal error: the step's plan would overrun its "
                                  "{what} buffer (capacity {limit}), a broken invariant of the "
                                  "scheduler; the step was refused before the write and nothing "
                                  "of it is pending"),
}


cdef object _error(int layer, int rc, int64_t arg=0, int64_t token=0, uint64_t limit=0):
    """The exception for status code `rc` returned to `layer` (see the tables above); `arg` is
    the failing row (or a backend's status), `token` and `limit` what a message names."""
    plain = _PLAIN.get(rc)
    if plain is not None:
        cls, text = <tuple>plain
        if text is None:
            return cls(arg)
        return cls((<str>text).format(row=arg, token=token, limit=limit,
                                      what=_PLAN_BUFFER_NAMES[arg]
                                      if 0 <= arg < len(_PLAN_BUFFER_NAMES) else "?"))
    chain = (<tuple>_ERRORS[layer])[rc] if 0 <= rc < Q_CODES else None
    if chain is None:
        return SystemError(f"qualia internal error: status {rc} in error layer {layer}")
    err = None
    for cls in reversed(<tuple>chain):
        err = cls() if err is None else cls(err)
    return err
