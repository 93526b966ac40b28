"""A dump's images made restorable elsewhere, after CRIU wrote them and before they are
hashed (or sealed by the node agent): what the snapshot carries besides memory changes
how some files and connections come back. Above both the image rewrites
(core/criu/images.py) and the connections (tcpconns.py), which reads those images."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from ..criu.images import (
    FE_TYPE,
    Field,
    ints,
    open_external_files_by_fd,
    rewrite_files_img,
    sub_message,
    with_sub_message,
)
from . import tcpconns, waits

#: FileEntry's unix socket (fdinfo.proto), and UnixSkEntry's owner and "deleted" fields
#: (sk-unix.proto).
FD_TYPE_UNIXSK, FE_USK = 5, 16
USK_FILE_PERMS, USK_DELETED = 13, 15


def fix_for_restore(images_dir: Path, open_by_fd: Collection[str], tcp_kept: bool) -> None:
    """The external files ``open_by_fd`` reopened through the descriptors a restore
    hands over, with ``tcp_kept`` the connections to peers outside the tree made closed
    (a restore keeps those inside), timed waits the dump interrupted restarted
    (:mod:`.waits`), and sockets whose files are gone without an owner
    (:func:`unowned_deleted_sockets`)."""
    waits.restart_interrupted_waits(images_dir)
    unowned_deleted_sockets(images_dir)
    if tcp_kept:
        tcpconns.close_outside_connections(images_dir)
    if open_by_fd:
        open_external_files_by_fd(images_dir, set(open_by_fd))


def unowned_deleted_sockets(images_dir: Path) -> int:
    """Drop the owner CRIU saved for each unix socket whose file had been removed (the
    endpoints of a kernel behind the bridge, kernel_wrapper.inkernel.bridge); returns
    how many.

    Without CAP_NET_ADMIN (non-root mode) CRIU cannot ask the socket for its file
    (SIOCUNIXFILE), finds none by its name, and saves root as its owner; the restore, which
    binds the socket at that name for a moment and removes it again, then fails to give it
    that owner ("Unable to change ... ownership ... to (0, 0): Operation not permitted").
    With no owner saved CRIU leaves the moment's file as it binds it."""

    def change(entry: list[Field]) -> list[Field] | None:
        if ints(entry, FE_TYPE) != [FD_TYPE_UNIXSK]:
            return None
        usk = sub_message(entry, FE_USK)
        if usk is None or ints(usk, USK_DELETED) != [1]:
            return None
        if not any(number == USK_FILE_PERMS for number, _, _ in usk):
            return None
        return with_sub_message(entry, FE_USK, [f for f in usk if f[0] != USK_FILE_PERMS])

    return rewrite_files_img(images_dir, change)
