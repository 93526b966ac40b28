"""The agent's dumps through CRIU's RPC (``criu swrk FD``), so that it hears of the freeze.

In-pod mode learns that CRIU holds the dumped tree frozen from an action script
(core/criu/frozen.py), which CRIU executes by its path. The agent cannot do that: its
CRIU runs in the pod's mount namespace and closes its descriptors before it executes a
script, so the path would name a file of the pod's (or a script whose interpreter,
``/bin/sh``, is the pod's), run with the capabilities the agent gives CRIU. In RPC mode
CRIU asks its client instead (``notify_scripts``): a NOTIFY message at each of its
steps, answered before it goes on; at ``post-dump`` the tree is dumped and still frozen.

The options are the command line of a CLI dump, given before ``swrk`` (CRIU parses them
first; ``--ghost-limit`` has no 32-bit ceiling there; a tracked dump's ``--track-mem``
and ``--prev-images-dir``, a pre-dump's ``--pre-dump-mode read``); the request adds what
only RPC carries: the pid, the images directory, the log's level and name, and the
notifications. A pre-copy round is a SINGLE_PRE_DUMP request of the same kind.
Messages are CRIU's protobufs (images/rpc.proto: criu_req, criu_opts, criu_resp), one per
datagram on a SOCK_SEQPACKET pair, written and read with the codec of
core/criu/images.py (only the fields used here).
"""

from __future__ import annotations

import socket
from collections.abc import Callable

from jupyter_ext.core.criu.images import Field, decode, encode, ints, sub_message
from jupyter_ext.core.criu.log import DUMP_LOG_LEVEL

#: criu_req_type (rpc.proto).
REQ_DUMP, REQ_NOTIFY, REQ_SINGLE_PRE_DUMP = 1, 6, 13
#: criu_req's fields.
_REQ_TYPE, _REQ_OPTS, _REQ_NOTIFY_SUCCESS = 1, 2, 3
#: criu_opts' fields.
_OPT_IMAGES_DIR_FD, _OPT_PID, _OPT_LOG_LEVEL, _OPT_LOG_FILE = 1, 2, 9, 10
_OPT_NOTIFY_SCRIPTS, _OPT_IMAGES_DIR = 12, 68
#: criu_resp's fields, and criu_notify's.
_RESP_TYPE, _RESP_SUCCESS, _RESP_NOTIFY, _RESP_ERRMSG = 1, 2, 5, 9
_NOTIFY_SCRIPT = 1
#: The largest message CRIU sends (a response with its first error's text).
MAX_MESSAGE = 64 * 1024
#: The step at which the dumped tree is still frozen, the last before it runs again.
POST_DUMP = "post-dump"


def _varint_field(number: int, value: int) -> Field:
    return (number, 0, value & (1 << 64) - 1)  # int32 -1: ten bytes, as protobuf writes it


def dump_request(pid: int, images_dir: str, log_file: str, *, pre_dump: bool = False) -> bytes:
    """criu_req DUMP of ``pid`` into ``images_dir`` (a path CRIU opens itself), logging
    at :data:`DUMP_LOG_LEVEL` into ``log_file`` in its work directory, asking at each step; with
    ``pre_dump``, SINGLE_PRE_DUMP (one ``criu pre-dump``, which asks nothing)."""
    opts: list[Field] = [
        _varint_field(_OPT_IMAGES_DIR_FD, -1),  # required; -1: images_dir names it
        _varint_field(_OPT_PID, pid),
        _varint_field(_OPT_LOG_LEVEL, DUMP_LOG_LEVEL),
        (_OPT_LOG_FILE, 2, log_file.encode()),
        *([] if pre_dump else [_varint_field(_OPT_NOTIFY_SCRIPTS, 1)]),
        (_OPT_IMAGES_DIR, 2, images_dir.encode()),
    ]
    kind = REQ_SINGLE_PRE_DUMP if pre_dump else REQ_DUMP
    return encode([_varint_field(_REQ_TYPE, kind), (_REQ_OPTS, 2, encode(opts))])


def notify_answer(success: bool) -> bytes:
    answer = [_varint_field(_REQ_TYPE, REQ_NOTIFY), _varint_field(_REQ_NOTIFY_SUCCESS, success)]
    return encode(answer)


def converse(sock: socket.socket, request: bytes, at_post_dump: Callable[[], bool]) -> str | None:
    """Send ``request`` to ``criu swrk`` on ``sock`` and answer its notifications,
    ``post-dump`` with what ``at_post_dump`` returns (False fails the dump, the tree runs
    on); the others with success. Returns None once the dump succeeded, else CRIU's
    first error (empty if it said none)."""
    sock.sendall(request)
    while True:
        data = sock.recv(MAX_MESSAGE)
        if not data:
            return "CRIU ended without an answer"
        response = decode(data)
        if ints(response, _RESP_TYPE) == [REQ_NOTIFY]:
            notify = sub_message(response, _RESP_NOTIFY) or []
            script = next((v for n, _, v in notify if n == _NOTIFY_SCRIPT), b"")
            step = script.decode(errors="replace") if isinstance(script, bytes) else ""
            sock.sendall(notify_answer(at_post_dump() if step == POST_DUMP else True))
            continue
        if ints(response, _RESP_SUCCESS) == [1]:
            return None
        errmsg = next((v for n, _, v in response if n == _RESP_ERRMSG), b"")
        return errmsg.decode(errors="replace") if isinstance(errmsg, bytes) else ""
