"""Reading and rewriting CRIU's ``files.img`` (without CRIU's own tools).

CRIU images are two magic words and then length-prefixed protobuf messages. files.img holds
one FileEntry per file (criu/images/fdinfo.proto); only the few fields the product
rewrites are decoded: an inet socket's InetSkEntry (sk-inet.proto, core/carried/tcpconns.py) and a
regular file's RegFileEntry (regfile.proto, core/carried/shmfiles.py). Everything else is copied
as it was.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from pathlib import Path

FE_TYPE, FE_REG, FE_ISK = 1, 3, 4
FD_TYPE_REG, FD_TYPE_INETSK = 1, 4
_HEADER = 8  # two u32 magics

Field = tuple[int, int, "int | bytes"]


def varint(data: bytes, pos: int) -> tuple[int, int]:
    """A protobuf varint at ``pos``: (its value, the position after it)."""
    result = shift = 0
    while True:
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def put_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def decode(data: bytes) -> list[Field]:
    fields: list[Field] = []
    pos = 0
    while pos < len(data):
        key, pos = varint(data, pos)
        number, wire = key >> 3, key & 7
        value: int | bytes
        if wire == 0:
            value, pos = varint(data, pos)
        elif wire == 2:
            length, pos = varint(data, pos)
            value, pos = data[pos : pos + length], pos + length
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            value, pos = data[pos : pos + size], pos + size
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        fields.append((number, wire, value))
    return fields


def encode(fields: list[Field]) -> bytes:
    out = bytearray()
    for number, wire, value in fields:
        out += put_varint(number << 3 | wire)
        if wire == 0:
            assert isinstance(value, int)
            out += put_varint(value)
        elif wire == 2:
            assert isinstance(value, bytes)
            out += put_varint(len(value)) + value
        else:
            assert isinstance(value, bytes)
            out += value
    return bytes(out)


def ints(fields: list[Field], number: int) -> list[int]:
    values: list[int] = []
    for n, wire, value in fields:
        if n != number:
            continue
        if wire == 2 and isinstance(value, bytes):  # packed
            pos = 0
            while pos < len(value):
                item, pos = varint(value, pos)
                values.append(item)
        elif isinstance(value, int):
            values.append(value)
    return values


def read_entries(path: Path) -> tuple[bytes, list[bytes]]:
    """An image's header and its entries (each a serialized message)."""
    data = path.read_bytes()
    header, pos, entries = data[:_HEADER], _HEADER, []
    while pos < len(data):
        (size,) = struct.unpack_from("<I", data, pos)
        entries.append(data[pos + 4 : pos + 4 + size])
        pos += 4 + size
    return header, entries


def write_entries(path: Path, header: bytes, entries: list[bytes]) -> None:
    """Replace an image by ``header`` and ``entries`` (atomically)."""
    out = bytearray(header)
    for raw in entries:
        out += struct.pack("<I", len(raw)) + raw
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(bytes(out))
    tmp.replace(path)


def sub_message(entry: list[Field], number: int) -> list[Field] | None:
    """The decoded sub-message in field ``number`` of ``entry``, if it has one."""
    blob = next((v for n, _, v in entry if n == number and isinstance(v, bytes)), None)
    return decode(blob) if blob is not None else None


def with_sub_message(entry: list[Field], number: int, sub: list[Field]) -> list[Field]:
    """``entry`` with its field ``number`` replaced by ``sub``."""
    return [(n, w, encode(sub) if n == number else v) for n, w, v in entry]


def rewrite_files_img(images_dir: Path, change: Callable[[list[Field]], list[Field] | None]) -> int:
    """Apply ``change`` to each decoded FileEntry of files.img (None: keep it as it is);
    rewrite the image if any changed. Returns how many changed."""
    path = images_dir / "files.img"
    header, entries = read_entries(path)
    changed = 0
    for index, raw in enumerate(entries):
        new = change(decode(raw))
        if new is not None:
            entries[index] = encode(new)
            changed += 1
    if changed:
        write_entries(path, header, entries)
    return changed


_REG_FLAGS, _REG_NAME = 2, 6


def open_external_files_by_fd(images_dir: Path, keys: set[str]) -> int:
    """Let a restore open the external files ``keys`` through the fds it inherits.

    CRIU reopens an external file as ``/proc/self/fd/N`` with the flags it was opened
    with; ``shm_open`` adds ``O_NOFOLLOW``, which refuses that magic link ("Too many levels
    of symbolic links"). The flag only matters when a path is opened: it is dropped from
    those entries. Returns how many entries changed."""

    def change(entry: list[Field]) -> list[Field] | None:
        if ints(entry, FE_TYPE) != [FD_TYPE_REG]:
            return None
        reg = sub_message(entry, FE_REG) or []
        name = next((v for n, _, v in reg if n == _REG_NAME and isinstance(v, bytes)), b"")
        flags = ints(reg, _REG_FLAGS)
        if name.decode(errors="replace") not in keys or not flags or not flags[0] & os.O_NOFOLLOW:
            return None
        reg = [
            (n, w, v & ~os.O_NOFOLLOW if n == _REG_FLAGS and isinstance(v, int) else v)
            for n, w, v in reg
        ]
        return with_sub_message(entry, FE_REG, reg)

    return rewrite_files_img(images_dir, change)
