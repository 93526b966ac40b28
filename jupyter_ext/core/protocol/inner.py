"""The wire between a wrapper and its inner kernel: the channels' socket numbers in the
wrapper's private directory, and the frame that numbers what the kernel sends."""

from __future__ import annotations

import struct

#: The inner kernel's channels, ``ch-N`` sockets in the wrapper's private directory
#: (environment.ENV_INNER_DIR) (the wrapper binds,
#: the kernel connects); the snapshot agent in the kernel is ``ch-7``.
INNER_PORTS = {"shell": 1, "stdin": 2, "control": 3, "iopub": 4, "hb": 5, "fork_pipe": 6}
AGENT_PORT = 7
#: A kernel other than ipykernel binds its channels as ``kernel-N`` sockets in that
#: directory, which the bridge in its tree connects to (kernel_wrapper.inkernel.bridge);
#: one that cannot says why in the file :data:`REFUSED_FILE` there.
KERNEL_PORTS = {"shell": 1, "stdin": 2, "control": 3, "iopub": 4, "hb": 5}
REFUSED_FILE = "kernel-refused"

#: The channels on which the inner kernel numbers what it sends (kernel_wrapper.inkernel.gate).
NUMBERED_CHANNELS = ("shell", "stdin", "control", "iopub")
#: The first bytes of the frame the kernel puts before each message on those channels:
#: then its epoch (4 bytes) and the message's number in that epoch (8 bytes), big-endian.
NUMBER_PREFIX = b"\x00ksn"
_NUMBER = struct.Struct(">4sIQ")


def number_frame(epoch: int, number: int) -> bytes:
    """The frame that numbers a message from the inner kernel."""
    return _NUMBER.pack(NUMBER_PREFIX, epoch, number)


def read_number(frame: bytes) -> tuple[int, int] | None:
    """(epoch, number) of a numbering frame; None for any other frame (a message of a
    kernel started before numbering, or of a forked child)."""
    if len(frame) != _NUMBER.size or not frame.startswith(NUMBER_PREFIX):
        return None
    _, epoch, number = _NUMBER.unpack(frame)
    return epoch, number
