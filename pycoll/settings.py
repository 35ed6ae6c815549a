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
