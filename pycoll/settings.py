"""On/off settings from the environment, read alike everywhere."""

from __future__ import annotations

import os


def switch(name: str, default: bool | None) -> bool | None:
    """``name``'s value as 0 or 1 (spaces around it ignored); unset or empty: ``default``.
    Anything else raises, naming the variable (a ``PYCOLL_DEBUG=false`` read as on, or a
    ``PYCOLL_MPI=yes`` as unset, would go unnoticed)."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    if text not in ("0", "1"):
        raise ValueError(f"{name}={text!r} is invalid; allowed: 0 or 1")
    return text == "1"


def whole_number(name: str, low: int, high: int | None = None, unit: str = "") -> int | None:
    """``name``'s value as an int in ``low..high`` (no ``high``: no upper bound); unset or
    empty: None. Every integer setting reads alike: ASCII, with the sign and underscores
    ``int()`` takes (int() also reads '²' and '٣', which no one types on purpose)."""
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    try:
        value = int(text) if text.isascii() else None
    except ValueError:
        value = None
    if value is None or value < low or (high is not None and value > high):
        allowed = f"an int >= {low}" if high is None else f"an int in {low}..{high}"
        raise ValueError(f"{name}={text!r} is invalid; allowed: {allowed}"
                         + (f" ({unit})" if unit else "") + ", or unset")
    return value
