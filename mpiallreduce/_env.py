"""Numeric settings read from the environment, with one error for a bad value."""

from __future__ import annotations

import os


def env_int(name: str, default: int, least: int = 0) -> int:
    """``int(os.environ[name])`` where set and not blank, else ``default``; ValueError naming the
    variable where the value is not an integer of at least ``least``."""
    return _env_number(name, default, least, int, "an integer")


def env_float(name: str, default: float, least: float = 0.0) -> float:
    """``float(os.environ[name])`` where set and not blank, else ``default``; ValueError naming
    the variable where the value is not a number of at least ``least``."""
    return _env_number(name, default, least, float, "a number")


def _env_number(name: str, default, least, kind, what: str):
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not value >= least:  # (NaN is not >= anything)
        raise ValueError(f"{name}={text!r}: expected {what} >= {least}")
    return value
