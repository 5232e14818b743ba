"""The Python backend protocol (DESIGN.md "Backends").

A decode backend is any object with ``execute_ragged``; it is called exactly once per decode round
with zero-copy numpy views of the scheduler's buffers.  A backend that also implements
``copy_pages`` can take copy-on-write page copies from the facade ``qualia.Scheduler``.

C/C++/CUDA backends skip Python entirely: they expose ``__qualia_backend__``, a PyCapsule named
``"qualia.backend.v1"`` holding a ``qualia_backend`` struct (see ``qualia.h``).
"""

from __future__ import annotations

from typing import Protocol, Tuple, Union, runtime_checkable

import numpy as np

from ._types import RaggedBatchReceipt

__all__ = ["RaggedBackend", "CopyPagesBackend"]


@runtime_checkable
class RaggedBackend(Protocol):
    def execute_ragged(
        self, items: np.ndarray, block_table: np.ndarray, outputs: np.ndarray
    ) -> Union[RaggedBatchReceipt, Tuple[int, int]]:
        """Run one decode step for every item.

        ``items`` (RAGGED_BATCH_ITEM, read-only): one record per decoding request, in slot
        order; ``block_table`` (uint32, read-only): the requests' page tables concatenated, item
        ``i`` owns ``block_table[items[i].block_table_offset :][: items[i].logical_pages]``;
        ``outputs`` (RAGGED_BATCH_OUTPUT, writable): write ``request_id``, ``slot`` and
        ``next_token_id`` for each item, in the same order.  Return
        ``(batch_size, backend_launches)``: ``(len(items), 1)`` for one fused launch.  Raise to
        fail the round (nothing in the scheduler changes).
        """
        ...


@runtime_checkable
class CopyPagesBackend(RaggedBackend, Protocol):
    def copy_pages(self, copies: np.ndarray) -> None:
        """Copy physical KV page ``src_page`` to ``dst_page`` for each COPY_OP record, in order,
        before the round that writes into ``dst_page``."""
        ...
