"""The configuration checks' shared vocabulary: :class:`ConfigError` and the range check every section uses.

Each section's dataclass checks itself beside the code that reads it (``check()``);
:func:`ext_proc.config.load_config` calls them all. This module imports nothing of pd-extproc.
"""

from __future__ import annotations

from urllib.parse import urlsplit


class ConfigError(ValueError):
    """Invalid configuration; the message names the key and the allowed values."""


def in_range(
    key: str,
    value: float,
    low: float,
    high: float,
    *,
    kind: str = "a number",
    low_open: bool = False,
    note: str = "",
) -> None:
    """Raise :class:`ConfigError` unless ``low <= value <= high`` (``low < value`` when ``low_open``).

    The message reads ``"{key}: must be {kind} in [low, high] ({note})"``, ``(low`` when ``low_open``,
    the note only when given; a whole float bound prints without its ``.0``. NaN is never in range.
    """
    inside = low < value <= high if low_open else low <= value <= high
    if not inside:
        opening = "(" if low_open else "["
        suffix = f" ({note})" if note else ""
        raise ConfigError(f"{key}: must be {kind} in {opening}{_bound(low)}, {_bound(high)}]{suffix}")


def _bound(number: float) -> str:
    """``number`` as a message shows it: ``1795`` for ``1795.0``, ``0.001`` as it is."""
    return str(int(number)) if float(number).is_integer() else str(number)


def check_url_port(key: str, url: str) -> None:
    """Raise :class:`ConfigError` when ``url`` names a port that is not a number in 1..65535.

    No port is fine (the scheme's own); the message reads ``"{key}: {url!r} is not allowed: its port is
    not a number in 1..65535"``."""
    try:
        port = urlsplit(url).port
    except ValueError:  # out of range, or not a number
        port = 0
    if port == 0:
        raise ConfigError(f"{key}: {url!r} is not allowed: its port is not a number in 1..65535")
