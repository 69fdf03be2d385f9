"""Storage levels of a KV entry."""

from __future__ import annotations

import enum


class Precision(enum.IntEnum):
    """Storage level of a KV entry, cheapest first (RELEASED holds nothing)."""
    RELEASED = 0
    INT4 = 1
    INT8 = 2
    HIGH = 3


BITS = {Precision.HIGH: 0, Precision.INT8: 8, Precision.INT4: 4}   # 0: the model dtype
