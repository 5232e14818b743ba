"""ctypes mirrors of the ABI structs (csrc/qualia.h), for tests that hand the core ctypes buffers
(which export the buffer protocol with NULL strides and their own format strings)."""

import ctypes


class CItem(ctypes.Structure):
    _fields_ = [("request_id", ctypes.c_uint64), ("slot", ctypes.c_uint32),
                ("token_id", ctypes.c_uint32), ("position", ctypes.c_uint32),
                ("block_table_offset", ctypes.c_uint32), ("logical_pages", ctypes.c_uint32),
                ("_reserved", ctypes.c_uint32)]


class COutput(ctypes.Structure):
    _fields_ = [("request_id", ctypes.c_uint64), ("slot", ctypes.c_uint32),
                ("next_token_id", ctypes.c_uint32)]


class CView(ctypes.Structure):
    _fields_ = [("request_id", ctypes.c_uint64), ("slot", ctypes.c_uint16),
                ("state", ctypes.c_uint8), ("token_count", ctypes.c_uint32),
                ("prefix_tokens", ctypes.c_uint32)]


class CCopy(ctypes.Structure):
    _fields_ = [("src_page", ctypes.c_uint32), ("dst_page", ctypes.c_uint32)]


_u32, _p = ctypes.c_uint32, ctypes.c_void_p

# qualia_step_plan: 16 u32 counts, then 18 pointers (the order of csrc/qualia.h)
STEP_PLAN_COUNTS = ["struct_size", "page_tokens", "num_requests", "num_tokens", "num_sampled",
                    "num_prefill_tokens", "num_decode_tokens", "num_kv_indices",
                    "block_table_num_rows", "block_table_num_cols", "block_table_row_stride",
                    "num_changed_rows", "num_copies", "num_new", "num_preempted",
                    "num_finished"]
STEP_PLAN_POINTERS = ["request_ids", "query_start_loc", "seq_lens", "input_ids", "positions",
                      "slot_mapping", "logits_indices", "sampled_request_ids", "block_table",
                      "block_table_rows", "changed_rows", "kv_indptr", "kv_indices",
                      "kv_last_page_len", "copies", "new_request_ids", "preempted_request_ids",
                      "finished_request_ids"]


# appended in the same ABI version (a backend reads them when struct_size covers them): beam rows
STEP_PLAN_TAIL = [("num_topk", _u32), ("num_forks", _u32), ("topk_ids_out", _p),
                  ("topk_logprobs_out", _p), ("fork_child_ids", _p), ("fork_parent_ids", _p)]


class CStepPlan(ctypes.Structure):
    _fields_ = ([(n, _u32) for n in STEP_PLAN_COUNTS] + [(n, _p) for n in STEP_PLAN_POINTERS]
                + STEP_PLAN_TAIL)


class CStepBackend(ctypes.Structure):
    _fields_ = [("abi_version", _u32), ("struct_size", _u32), ("flags", _u32),
                ("_reserved", _u32), ("ctx", _p), ("execute_step", _p), ("copy_pages", _p)]


EXECUTE_STEP = ctypes.CFUNCTYPE(ctypes.c_int32, _p, ctypes.POINTER(CStepPlan), _p, _p)


_CAPSULES = []   # what ctypes step capsules point into, kept alive for the session


def step_capsule(execute, flags=0):
    """A step backend capsule over a ctypes ``EXECUTE_STEP`` callback with the given flags (the
    capsule holds raw pointers into objects kept alive for the session)."""
    iface = CStepBackend(1, ctypes.sizeof(CStepBackend), flags, 0, None,
                         ctypes.cast(execute, ctypes.c_void_p), None)
    name = b"qualia.step_backend.v1"
    _CAPSULES.append((iface, execute, name))
    new = ctypes.pythonapi.PyCapsule_New
    new.restype = ctypes.py_object
    new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    return new(ctypes.addressof(iface), name, None)


def c_array(ctype, address, n):
    """The n records at `address` as a list (empty for n == 0)."""
    return list((ctype * n).from_address(address)) if n else []
