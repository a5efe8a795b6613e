"""Sizes in bytes as people write and read them: '512MiB' -> 536870912 (`parse_size`), 1536 -> '1.5 KiB'
(`human_bytes`). The one place for both, used by the options (engine/run/config.py), the report and the cache."""
from __future__ import annotations

import math

from prefixrun.engine.errors import InvalidOption

_UNITS = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "kb": 10 ** 3, "mb": 10 ** 6,
          "gb": 10 ** 9, "tb": 10 ** 12, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "b": 1}


def parse_size(text: str | None, what: str, allow_fraction: bool = False, minimum: int = 0) -> int | float | None:
    """'512MiB', '2GB', '1e9' -> bytes; with allow_fraction, '0.25' -> the float 0.25, for the caller to scale.

    Raises InvalidOption (one line) for anything else: words, negative, infinite or NaN sizes, a fraction where
    none is allowed, or less than `minimum` bytes.
    """
    if text is None:
        return None
    s = text.strip().lower().replace(" ", "")
    for suffix, mult in sorted(_UNITS.items(), key=lambda kv: -len(kv[0])):
        if s.endswith(suffix):
            s, factor = s[:-len(suffix)], mult
            break
    else:
        factor = 1
    example = "e.g. 512MiB, 2GB" + (", or a fraction like 0.25" if allow_fraction else "")
    try:
        value = float(s)
    except ValueError:
        raise InvalidOption(f"{what}: {text!r} is not a size ({example})") from None
    if not math.isfinite(value) or value * factor >= 2 ** 63:
        raise InvalidOption(f"{what}: {text!r} is not a usable size ({example})")
    if value < 0:
        raise InvalidOption(f"{what} must not be negative")
    if factor == 1 and 0 < value < 1:
        if not allow_fraction:
            raise InvalidOption(f"{what}: {text!r} is a fraction; give a size ({example})")
        return value  # the total it is a fraction of is only known later (state memory depends on the device)
    if factor == 1 and value != int(value):
        # '1.5' is neither a fraction (those are below 1) nor a number of bytes: refused, never taken as 1 byte
        raise InvalidOption(f"{what}: {text!r} is not a whole number of bytes; give a unit ({example})")
    size = int(value * factor)
    if size < minimum:
        raise InvalidOption(f"{what}: {text!r} is too small (at least {minimum:,} bytes)")
    return size


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB': bytes in the largest binary unit below 1024 of it (up to TiB), thousands separated."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return f"{n:,.1f} TiB"
