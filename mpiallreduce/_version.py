"""The package's version (one place: the package root and the kept picks' fingerprint read it)."""

__version__ = "0.1.0"
