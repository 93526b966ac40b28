"""Sizes and times as people read them."""

from __future__ import annotations

from datetime import UTC, datetime


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_seconds(seconds: float) -> str:
    """0.0123 -> '12 ms', 75 -> '1 min 15 s'."""
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"


def time_ago(iso: str, now: datetime | None = None) -> str:
    """An ISO timestamp as '3 min ago'."""
    then = datetime.fromisoformat(iso)
    if then.tzinfo is None:
        then = then.replace(tzinfo=UTC)
    delta = ((now or datetime.now(UTC)) - then).total_seconds()
    if delta < 0:
        return "just now"
    for size, unit in ((86400, "day"), (3600, "h"), (60, "min")):
        if delta >= size:
            count = int(delta // size)
            plural = "s" if unit == "day" and count > 1 else ""
            return f"{count} {unit}{plural} ago"
    return f"{int(delta)} s ago"
