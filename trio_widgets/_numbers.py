"""Number checks every layer needs (types, validation, the loop), kept below all of them."""

from __future__ import annotations

import math
from typing import Any

import numpy as np


def is_int(value: Any) -> bool:
    """An integer that is not a bool (True is an int to Python, never a count to a user)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    """A real number that is not a bool."""
    return isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool)


def is_finite_number(value: Any) -> bool:
    """A real number (not a bool) that is finite as a float: 10**400 is not (it overflows)."""
    if not is_number(value):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:
        return False
