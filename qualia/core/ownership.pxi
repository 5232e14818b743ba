# Ownership: a mutating call on an object that a decode round holds raises BusyError.

cdef inline int _check_busy(int busy, str what) except -1:
    if busy:
        raise BusyError(None, f"the {what} is in use by a decode round; retry after it")
    return 0
