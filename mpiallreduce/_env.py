"""Integer settings read from the environment, with one error for a bad value."""

from __future__ import annotations

import os


def env_int(name: str, default: int, least: int = 0) -> int:
    """``int(os.environ[name])`` where set and not blank, else ``default``; ValueError naming the
    variable where the value is not an integer of at least ``least``."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        value = least - 1
    if value < least:
        raise ValueError(f"{name}={text!r}: expected an integer >= {least}")
    return value
