# Ownership (docs/DESIGN.md, "Ownership"): who may mutate an object, and when.
#
# BlockPool, PrefixKvStore, RequestScheduler, Scheduler and StepScheduler each have an `owner`
# field: 0 when free, otherwise the token of the call (or, for the pool a StepScheduler lends,
# of the StepScheduler itself, for its whole life) that holds the object.  Every mutating call
#
#   1. RESOLVES everything that can run Python code before it looks at any state: integer
#      arguments (__index__), namespaces, tokens (into private memory), the backend (capsule
#      lookup, bound methods), caller buffers;
#   2. ACQUIRES every object it will touch with own_acquire(): with the GIL held and no Python
#      code in between, either every object is free and all are stamped with one fresh token, or
#      BusyError is raised and nothing changes;
#   3. MUTATES (C functions), builds its result, and RELEASES in a `finally` clause with
#      own_release(), which clears only the fields that still hold its token: only the owner
#      releases.
#
# While a call owns an object, anything else that runs -- a Python backend, a GC callback, a
# weakref finalizer, another thread while a C backend runs without the GIL -- gets BusyError from
# every mutating call on it and changes nothing.  Read-only calls take no ownership: they copy
# the state they read into C memory before they build Python objects (an allocation can run a GC
# callback that mutates).  The core changes state without the GIL in one place, the loop of
# StepScheduler.run() with a C step backend; reads are refused while it runs (own_readable below).

cdef uint64_t _own_seq = 0


cdef uint64_t own_acquire(uint64_t *a, uint64_t *b, uint64_t *c, uint64_t *d) except 0:
    """Stamp every non-NULL owner field with a fresh token if all are free; else BusyError."""
    global _own_seq
    cdef uint64_t token
    if ((a != NULL and a[0] != 0) or (b != NULL and b[0] != 0)
            or (c != NULL and c[0] != 0) or (d != NULL and d[0] != 0)):
        raise BusyError(None, "the object is in use by another call (a decode round, its "
                              "backend, or another thread) or belongs to the StepScheduler "
                              "that lends it; nothing was changed")
    _own_seq += 1
    if _own_seq == 0:   # 2**64 calls later
        _own_seq = 1
    token = _own_seq
    if a != NULL:
        a[0] = token
    if b != NULL:
        b[0] = token
    if c != NULL:
        c[0] = token
    if d != NULL:
        d[0] = token
    return token


# A GIL-free section that changes state (StepScheduler.run() with a C step backend: the whole
# schedule -> execute -> update loop runs without the GIL) sets `gil_free` on the scheduler and
# on the pool it lends, with the GIL, before it lets the GIL go, and clears it after it has
# the GIL back.  While it is set every read of those objects raises BusyError (reads included:
# the loop changes what they would read); the one exception is the KV event ring, a
# single-producer, single-consumer ring that drain_events() consumes concurrently
# (core/cache/pagecache.pxi).  A read calls own_readable() after it has resolved its arguments (user
# code may run there, and with it another thread) and before it reads any state, with no
# Python code in between, so the check and the read happen under one holding of the GIL.
cdef inline int own_readable(uint8_t gil_free) except -1:
    if gil_free:
        raise BusyError(None, "a GIL-free section (StepScheduler.run() with a C step backend) is "
                              "changing this object; nothing was read, retry after it")
    return 0


cdef inline void own_release(uint64_t token, uint64_t *a, uint64_t *b, uint64_t *c,
                             uint64_t *d) noexcept:
    """Give back what `token` holds; a field some other token holds is left alone."""
    if a != NULL and a[0] == token:
        a[0] = 0
    if b != NULL and b[0] == token:
        b[0] = 0
    if c != NULL and c[0] == token:
        c[0] = 0
    if d != NULL and d[0] == token:
        d[0] = 0
