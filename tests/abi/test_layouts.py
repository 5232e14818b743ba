"""The C ABI: the numpy dtypes match the compiled structs, and both match the table of
DESIGN.md "C layouts"."""

import numpy as np
import pytest

import qualia
from qualia import _core

LAYOUTS = {
    "item": (qualia.RAGGED_BATCH_ITEM, 32, [("request_id", 0, "u8"), ("slot", 8, "u4"),
             ("token_id", 12, "u4"), ("position", 16, "u4"), ("block_table_offset", 20, "u4"),
             ("logical_pages", 24, "u4"), ("_reserved", 28, "u4")]),
    "output": (qualia.RAGGED_BATCH_OUTPUT, 16, [("request_id", 0, "u8"), ("slot", 8, "u4"),
               ("next_token_id", 12, "u4")]),
    "receipt": (qualia.RAGGED_BATCH_RECEIPT, 8, [("batch_size", 0, "u4"),
                ("backend_launches", 4, "u4")]),
    "request_view": (qualia.REQUEST_VIEW, 24, [("request_id", 0, "u8"), ("slot", 8, "u2"),
                     ("state", 10, "u1"), ("token_count", 12, "u4"), ("prefix_tokens", 16, "u4")]),
    "copy_op": (qualia.COPY_OP, 8, [("src_page", 0, "u4"), ("dst_page", 4, "u4")]),
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_dtype_matches_spec_and_compiled_struct(name):
    dtype, size, fields = LAYOUTS[name]
    csize, calign, cfields = _core._layout()[name]
    assert dtype.itemsize == size == csize
    assert dtype.alignment == calign
    assert list(dtype.names) == [f[0] for f in fields]
    for (fname, offset, kind), (cname, _fmt, coffset) in zip(fields, cfields):
        assert cname == fname
        assert dtype.fields[fname][1] == offset == coffset
        assert dtype.fields[fname][0] == np.dtype(kind).newbyteorder("<")


def test_request_state_is_one_byte_with_seed_values():
    assert qualia.REQUEST_VIEW.fields["state"][0].itemsize == 1
    assert [int(s) for s in qualia.RequestState] == [0, 1, 2]
    assert [s.name for s in qualia.RequestState] == ["EMPTY", "PREFILL", "DECODE"]


def test_backend_struct_and_capsule_constants():
    size, align, _ = _core._layout()["backend"]
    assert size == _core.BACKEND_STRUCT_SIZE == 32  # u32, u32, ctx, two function pointers
    assert qualia.BACKEND_CAPSULE_NAME == "qualia.backend.v1"
    assert qualia.BACKEND_ABI_VERSION == 1
