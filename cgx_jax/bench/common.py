"""What the benchmarks share: element counts written with suffixes (docs/design.md section
9)."""

from __future__ import annotations

import argparse
import re

_SUFFIXES = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    """``1M`` -> 1048576 elements, ``16M``, ``64M``, ``4096``.

    Example:
        >>> parse_size("64K")
        65536
    """
    m = re.fullmatch(r"\s*(\d+)\s*([kKmMgG]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"size must look like 4096, 64K, 1M or 16M: {text!r}")
    return int(m.group(1)) * _SUFFIXES[m.group(2).upper()]


def size_label(size: int) -> str:
    """The shortest suffixed name of ``size`` (``1 << 20`` -> ``1M``)."""
    for suffix in ("G", "M", "K"):
        if size % _SUFFIXES[suffix] == 0:
            return f"{size // _SUFFIXES[suffix]}{suffix}"
    return str(size)
