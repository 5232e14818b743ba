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
