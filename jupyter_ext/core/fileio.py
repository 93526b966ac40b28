"""File I/O the store and the page server share."""

from __future__ import annotations

import os


def pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """pwrite until all is written: a short write (a disk filling up) is followed by one
    that raises the error, rather than counted as done."""
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written
