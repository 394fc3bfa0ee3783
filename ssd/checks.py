"""Checks of values a user gives, shared by the engine's configuration (ssd/config.py), the
speculation options and the sampling parameters."""
from ssd.errors import SSDError


def is_int(x) -> bool:
    """An int, and not a bool (True would otherwise pass as 1)."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def check_int(name: str, value, lo: int, hi: int | None = None, *, also: str = "",
              error: type[SSDError] = SSDError) -> None:
    """Raise `error` unless value is an integer in lo..hi (hi None: no upper bound). also: the
    other values allowed, for the message (e.g. "or 'auto'"), which the caller checks first."""
    if is_int(value) and lo <= value and (hi is None or value <= hi):
        return
    bounds = f">= {lo}" if hi is None else f"in {lo}..{hi}"
    raise error(f"{name} must be an integer {bounds}{' ' + also if also else ''}, got {value!r}")
