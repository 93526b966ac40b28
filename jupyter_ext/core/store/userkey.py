"""A user's key-encryption key, derived from a secret only the hub service holds.

HKDF-SHA256 of the hub's secret with the user's name: the same user gets the same key from
any instance of the service, no key is stored, and no user's key says anything about
another's. A key id names which secret it came from, so a store can tell which key wrapped
what; after a rotation the service hands out the new secret's key as current and the old
ones' as previous, until everything is rewrapped.
"""

from __future__ import annotations

import hashlib

from .api import StoreError

KEY_BYTES = 32
MIN_SECRET_BYTES = 32
_INFO = b"jupyter-kernel-snapshots key-encryption key v1\0user\0"


def parse_secret(text: str, name: str) -> bytes:
    """A secret given as hex (``openssl rand -hex 32``), at least 32 bytes."""
    try:
        secret = bytes.fromhex(text.strip())
    except ValueError as exc:
        raise StoreError(
            f"{name} is not hexadecimal.",
            hint=f"Set {name} to 64 or more hex digits, e.g. from `openssl rand -hex 32`.",
        ) from exc
    if len(secret) < MIN_SECRET_BYTES:
        raise StoreError(
            f"{name} holds {len(secret)} bytes, fewer than {MIN_SECRET_BYTES}.",
            hint=f"Set {name} to 64 or more hex digits, e.g. from `openssl rand -hex 32`.",
        )
    return secret


def derive_user_key(secret: bytes, user: str) -> tuple[str, bytes]:
    """(key id, 32 bytes): the user's key-encryption key under ``secret``. The id is a hash
    of the key (it names key and secret, and reveals neither)."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    hkdf = HKDF(algorithm=hashes.SHA256(), length=KEY_BYTES, salt=None, info=_INFO + user.encode())
    key = hkdf.derive(secret)
    key_id = "hub-" + hashlib.sha256(b"key id\0" + key).hexdigest()[:24]
    return key_id, key
