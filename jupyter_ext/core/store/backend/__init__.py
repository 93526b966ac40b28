"""Backends move bytes and hold no policy (restic's ``internal/backend``): a local
directory and an S3 bucket, both laid out by :mod:`.layout`."""

from .base import Backend, Handle, Kind, ObjectStat

__all__ = ["Backend", "Handle", "Kind", "ObjectStat"]
