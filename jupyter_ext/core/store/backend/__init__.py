"""Backends move bytes and hold no policy (restic's ``internal/backend``): a local
directory, an S3 bucket and memory, all laid out by :mod:`.layout`. Each module also has
its :class:`~.base.Options`: its settings, and how it is opened from them."""

from .base import Backend, Handle, Kind, ObjectStat, Options, Settings

__all__ = ["Backend", "Handle", "Kind", "ObjectStat", "Options", "Settings"]
