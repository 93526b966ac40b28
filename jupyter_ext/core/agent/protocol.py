"""The node agent's protocol: typed, versioned requests over a unix SOCK_SEQPACKET socket.

The node agent (``jupyter_ext.nodeagent``, docs/agent.md) is root on the node and
unconfined; its callers are user pods at Pod Security "baseline". Every byte a caller
sends is untrusted: a request is parsed here into one frozen dataclass, every field
checked (type, range, pattern, count), and anything else is refused with an
:class:`AgentRequestError` that names the field. Nothing in a request says *who* asks or
*which pod*: the agent learns that from the kernel (``core/agent/peers.py``).

One message is one datagram: a JSON object, at most :data:`MAX_MESSAGE` bytes, with file
descriptors attached (SCM_RIGHTS) where an operation needs them::

    -> {"v": 2, "op": "dump", "args": {"pid": 4123, "leave_running": true, "externals": []}}
    <- {"v": 2, "ok": true, "result": {"files": [...], "seal": "...", ...}}  + one fd a file
    <- {"v": 2, "ok": false, "error": {"code": ..., "message": ..., "hint": ...}}

A datagram carries at most :data:`MAX_FDS` descriptors; a request or reply with more (the
images of a large tree) sends the rest in further ``{"v": 2, "more": N}`` datagrams, so
its names and the descriptors received pair up in order.

A dump with ``frozen_copy`` has one exchange before its reply: when CRIU has dumped the
tree and holds it frozen, the agent sends ``{"v": 2, "frozen": true}`` and waits for the
caller's ``{"v": 2, "copied": true}`` (its /dev/shm files and logs copied; ``false``: the
dump fails and the tree runs on) for at most :data:`FROZEN_COPY_SECONDS`.

Fields that only some requests need (a dump's ``open_by_fd``, ``frozen_copy``,
``keep_tcp``, ``track_mem`` and ``prev*``, a restore's ``keep_tcp`` and ``level_seals``)
have defaults and are not sent at them: an agent of before they existed serves the
requests that do not use them. A hello asks for the agent's ``dirty_tracking`` in such
a field (``tracking``); refused by an agent of before memory tracking, it is asked again
without, and the caller then neither tracks nor sends chains. A caller of before it gets
the hello it knows.

**Chains of memory levels** (core/criu/chain.py). A tracked dump copies only the pages
written since the tree's previous dump or pre-dump (``pre_dump``: copied while the tree
runs), whose images it is given as a *stub*: that dump's ``inventory.img`` and
``pagemap-N.img`` as descriptors (``prev``), each with its size and the seal the agent
gave it; the agent makes their empty ``pages-N.img`` itself. A restore of such a snapshot
gives the files of every level below its own images by their paths
(``parent/pages-1.img``, ``parent/parent/...``), each with its own seal
(``level_seals``): the levels come from several dumps.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import re
import socket
from collections.abc import Sequence
from dataclasses import MISSING, Field, dataclass, field, fields
from typing import Any, ClassVar, Self

from ..criu.chain import PARENT
from ..criu.options import GHOST_LIMIT_MAX
from ..errors import SnapshotError

#: The protocol version: a request of another version is refused, naming both. 2: a
#: restore gives each image's size; a dump never ends the kernel (``leave_running``); a
#: dump may keep connections and have its caller copy while frozen (``frozen_copy``);
#: memory tracking (``pre_dump``, a dump's ``track_mem`` and ``prev``, a restore's
#: ``level_seals``, the hello's ``dirty_tracking``) came later, in optional fields.
VERSION = 2
#: Where the agent listens in its own mount namespace, and where user pods see the socket
#: (the CSI volume's mount path, deploy/z2jh/config.yaml).
SOCKET_NAME = "agent.sock"
DEFAULT_SOCKET_DIR = "/run/jupyter-kernel-snapshots-agent"
#: The largest datagram either side sends or reads (a restore names ~100 files).
MAX_MESSAGE = 64 * 1024
#: Descriptors in one datagram (Linux allows 253: SCM_MAX_FD).
MAX_FDS = 200
#: The most image files a snapshot may have (a tree of many processes has a few per one).
MAX_FILES = 4096
#: Externals and inherited descriptors of one request.
MAX_EXTERNALS = 64
#: Process ids: 1 .. pid_max's ceiling (kernel/pid.c, PID_MAX_LIMIT).
PID_MAX = 4 * 1024 * 1024
#: The largest image file a restore may give: 1 TiB (the agent's --max-request-bytes caps
#: their sum).
IMAGE_SIZE_MAX = 1 << 40
#: How long the agent holds a tree frozen for its caller's copies (a dump's frozen_copy).
FROZEN_COPY_SECONDS = 600.0

#: The deepest chain of memory levels below a snapshot's own images (core/memtrack/plan.py
#: starts a new chain at 16 levels; a snapshot's pre-copy rounds add up to 3).
MAX_LEVELS = 32
#: How the agent's CRIU may track memory between dumps (``Criu.dirty_tracking``; "":
#: it cannot on this node).
DIRTY_TRACKING = ("", "userfaultfd", "soft-dirty")

_EXTERNAL = re.compile(r"file\[[0-9a-f]{1,16}:[0-9a-f]{1,16}\]")
_INHERITED = re.compile(r"pipe:\[[0-9]{1,20}\]|file\[[0-9a-f]{1,16}:[0-9a-f]{1,16}\]")
#: CRIU's image names (``core-4123.img``, ``pages-1.img``, ``stats-dump``...): no path.
_IMAGE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
_SEAL = re.compile(r"[0-9a-f]{64}")
#: What a level of a chain holds (core/criu/chain.py), and of it what a dump's stub sends.
_LEVEL_NAME = r"(inventory\.img|pagemap-[0-9]{1,10}\.img|pages-[0-9]{1,10}\.img)"
_PREV_FILE = re.compile(r"inventory\.img|pagemap-[0-9]{1,10}\.img")
#: A restore's files: its own images, and its levels' files by their paths below them.
_RESTORED_FILE = re.compile(rf"{_IMAGE_NAME.pattern}|({PARENT}/){{1,{MAX_LEVELS}}}{_LEVEL_NAME}")
_CRIU_VERSION = re.compile(r"[0-9]{1,4}(\.[0-9]{1,4}){0,3}")


class AgentRequestError(SnapshotError):
    """The node agent refused a request: malformed, of another version, or about
    processes or images that are not the caller's; the message names why."""

    code = "agent-refused"


class AgentUnavailableError(SnapshotError):
    """The node agent cannot be reached, or went away during a request."""

    code = "agent-unavailable"


class AgentIncompatibleError(SnapshotError):
    """The node agent answered in another protocol version, or with a reply this version
    cannot read: the user image and the agent's image are of different releases."""

    code = "agent-incompatible"


#: What to do when the user pod and the agent speak different protocol versions.
SAME_RELEASE_HINT = (
    "Run the same jupyter-kernel-snapshots release in the user pods' image "
    "(singleuser.image) and the node agent's (deploy/agent/agent.yaml): upgrade the "
    "DaemonSet together with the hub's image."
)


def _refuse(message: str) -> AgentRequestError:
    return AgentRequestError(
        f"The node agent refused the request: {message}.",
        hint="This is a bug of the caller, or a request that was not the product's; "
        "the agent's log names the pod that sent it.",
    )


@dataclass(frozen=True)
class _Request:
    """An operation's arguments; :meth:`parse` checks every field of a JSON object."""

    op: ClassVar[str]
    #: Descriptors the request carries: "none", "per-file" (files then inherited), ...
    fds: ClassVar[str] = "none"

    @classmethod
    def parse(cls, args: Any) -> Self:
        if not isinstance(args, dict):
            raise _refuse(f"{cls.op}: args must be an object")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(args) - names)
        if unknown:
            raise _refuse(f"{cls.op}: unknown field {unknown[0]!r}")
        required = {
            f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING
        }
        missing = sorted(required - set(args))
        if missing:
            raise _refuse(f"{cls.op}: missing field {missing[0]!r}")
        request = cls(**args)
        request.check()
        return request

    def check(self) -> None:
        """Raise AgentRequestError naming the first bad field."""

    def to_json(self) -> dict[str, Any]:
        """Every field, except those at their defaults (an agent of before they existed
        serves such a request)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if not _at_default(self, f)}

    def expected_fds(self) -> int:
        return 0


def _at_default(request: _Request, f: Field[Any]) -> bool:
    if f.default is not MISSING:
        return bool(getattr(request, f.name) == f.default)
    if f.default_factory is not MISSING:
        return bool(getattr(request, f.name) == f.default_factory())
    return False


def _check_pid(op: str, name: str, value: object) -> None:
    if type(value) is not int or not 1 < value <= PID_MAX:
        raise _refuse(f"{op}: {name} must be a process id (an integer 2..{PID_MAX})")


def _check_bool(op: str, name: str, value: object) -> None:
    if type(value) is not bool:
        raise _refuse(f"{op}: {name} must be true or false")


def _check_strings(
    op: str, name: str, value: object, pattern: re.Pattern[str], limit: int
) -> list[str]:
    if not isinstance(value, list) or len(value) > limit:
        raise _refuse(f"{op}: {name} must be a list of at most {limit} strings")
    for item in value:
        if not isinstance(item, str) or not pattern.fullmatch(item):
            shown = repr(item)[:80]
            raise _refuse(f"{op}: {name} has {shown}, not of the form {pattern.pattern}")
    if len(set(value)) != len(value):
        raise _refuse(f"{op}: {name} names an entry twice")
    return value


def _check_sizes(op: str, name: str, value: object, count: int) -> None:
    if (
        not isinstance(value, list)
        or len(value) != count
        or any(type(n) is not int or not 0 <= n <= IMAGE_SIZE_MAX for n in value)
    ):
        raise _refuse(
            f"{op}: {name} must be a list of {count} integers 0..{IMAGE_SIZE_MAX}, one per file"
        )


def _check_seals(op: str, name: str, value: object, count: int) -> None:
    if (
        not isinstance(value, list)
        or len(value) != count
        or any(not isinstance(s, str) or not _SEAL.fullmatch(s) for s in value)
    ):
        raise _refuse(f"{op}: {name} must be a list of {count} seals (64 hex digits), one per file")


def _check_prev(op: str, prev: object, sizes: object, seals: object) -> None:
    """A stub of the images a tracked dump builds on: an inventory and pagemaps, each with
    its size and seal (the module's docstring)."""
    names = _check_strings(op, "prev", prev, _PREV_FILE, MAX_FILES)
    if names and "inventory.img" not in names:
        raise _refuse(f"{op}: prev has no inventory.img")
    _check_sizes(op, "prev_sizes", sizes, len(names))
    _check_seals(op, "prev_seals", seals, len(names))


@dataclass(frozen=True)
class HelloRequest(_Request):
    """Who the agent takes the caller for, and its versions (doctor, tests)."""

    op: ClassVar[str] = "hello"
    tracking: bool = False
    """Ask also how the agent's CRIU tracks memory (:attr:`Hello.dirty_tracking`). An
    agent of before memory tracking refuses the field (the caller asks again without it);
    a caller of before it does not ask, and gets the hello it knows."""

    def check(self) -> None:
        _check_bool(self.op, "tracking", self.tracking)


@dataclass(frozen=True)
class Hello:
    """The agent's answer to a hello: its protocol version and CRIU, and who it takes the
    caller for (the pod name is the caller's identity for seals; the owner is read from
    it, for messages)."""

    version: int
    criu_version: str
    owner: str
    pod_name: str
    pod: str
    """The caller's pod cgroup."""
    container: str
    """The caller's container id."""
    dirty_tracking: str | None = None
    """How the agent's CRIU tracks memory between dumps on this node, as it runs for pods
    (one of :data:`DIRTY_TRACKING`, "" where it cannot), sent when asked
    (:attr:`HelloRequest.tracking`); None: an agent of before memory tracking."""

    @classmethod
    def parse(cls, result: Any) -> Hello:
        """The hello reply's ``result``, every field checked; AgentIncompatibleError
        names the first that is missing or not what this version sends."""
        names = [f.name for f in fields(cls)]
        required = [f.name for f in fields(cls) if f.default is MISSING]
        if not isinstance(result, dict) or not set(required) <= set(result) <= set(names):
            shown = sorted(result) if isinstance(result, dict) else type(result).__name__
            raise _incompatible(f"its hello has {shown}, not the fields {names}")
        for name in result:
            kind = int if name == "version" else str
            if type(result[name]) is not kind:
                shown = type(result[name]).__name__
                raise _incompatible(f"its hello's {name} is of type {shown}, not {kind.__name__}")
        if result["version"] != VERSION:
            raise _incompatible(f"it speaks protocol version {result['version']}")
        if not _CRIU_VERSION.fullmatch(result["criu_version"]):
            raise _incompatible(f"its hello's criu_version {result['criu_version'][:40]!r}")
        if result.get("dirty_tracking", "") not in DIRTY_TRACKING:
            raise _incompatible(f"its hello's dirty_tracking {result['dirty_tracking'][:40]!r}")
        return cls(**result)


def _incompatible(what: str) -> AgentIncompatibleError:
    return AgentIncompatibleError(
        f"The node agent's answer is not of protocol version {VERSION}, which this server "
        f"speaks: {what}.",
        hint=SAME_RELEASE_HINT,
    )


def check_reply_version(message: Any) -> None:
    """Every reply of the agent carries ``v``: one of another version is not read."""
    version = message.get("v") if isinstance(message, dict) else None
    if type(version) is not int or version != VERSION:
        raise _incompatible(f"it answered in protocol version {version!r}")


@dataclass(frozen=True)
class DumpRequest(_Request):
    """Dump the process tree of ``pid`` (a process id in the caller's own PID namespace)."""

    op: ClassVar[str] = "dump"
    pid: int
    leave_running: bool
    """False (a suspend): the tree is left stopped (SIGSTOP) after the dump, for the caller
    to end once it holds the images. The agent itself never ends a kernel: CRIU always
    dumps with ``--leave-running``, so an agent that dies during a dump loses nothing."""
    externals: list[str]
    """CRIU external keys (``file[MNT:INODE]``): resources a restore hands over."""
    ghost_limit: int
    """The largest deleted file the tree holds, in bytes (CRIU saves those in the images:
    Ray's object store is one)."""
    open_by_fd: list[str] = field(default_factory=list)
    """Of ``externals``, the files a restore reopens through the descriptor it hands over
    (the tree's /dev/shm files: core/criu/images.py fixes their entries before sealing)."""
    frozen_copy: bool = False
    """The caller copies files while the tree is frozen (its /dev/shm files, appended
    logs): the agent asks it then (the module's docstring)."""
    keep_tcp: bool = False
    """Connections inside the tree keep their state (TCP repair); the others are saved
    closed."""
    track_mem: bool = False
    """Protect the pages copied, so that a later dump can copy only those written since
    (CRIU's ``--track-mem``; the caller holds the kernel's tracker, docs/agent.md)."""
    prev: list[str] = field(default_factory=list)
    """The stub of the images this dump builds on (the module's docstring): only pages
    written since them are copied. Needs ``track_mem``."""
    prev_sizes: list[int] = field(default_factory=list)
    prev_seals: list[str] = field(default_factory=list)
    """Each file of ``prev``'s seal, as the agent's reply gave it (``seals``)."""

    def check(self) -> None:
        _check_pid(self.op, "pid", self.pid)
        _check_bool(self.op, "leave_running", self.leave_running)
        _check_strings(self.op, "externals", self.externals, _EXTERNAL, MAX_EXTERNALS)
        if type(self.ghost_limit) is not int or not 0 <= self.ghost_limit <= GHOST_LIMIT_MAX:
            raise _refuse(f"dump: ghost_limit must be an integer 0..{GHOST_LIMIT_MAX}")
        _check_strings(self.op, "open_by_fd", self.open_by_fd, _EXTERNAL, MAX_EXTERNALS)
        if not set(self.open_by_fd) <= set(self.externals):
            raise _refuse("dump: open_by_fd names a file that is not among externals")
        _check_bool(self.op, "frozen_copy", self.frozen_copy)
        _check_bool(self.op, "keep_tcp", self.keep_tcp)
        _check_bool(self.op, "track_mem", self.track_mem)
        _check_prev(self.op, self.prev, self.prev_sizes, self.prev_seals)
        if self.prev and not self.track_mem:
            raise _refuse("dump: prev needs track_mem")

    def expected_fds(self) -> int:
        return len(self.prev)


@dataclass(frozen=True)
class PreDumpRequest(_Request):
    """Copy the memory of the process tree of ``pid`` while it runs (``criu pre-dump
    --pre-dump-mode read --track-mem``): frozen only to read and protect its page tables.
    A later dump or pre-dump given these images as ``prev`` copies what was written
    since. ``prev``: as a dump's (without it, every page is copied)."""

    op: ClassVar[str] = "pre_dump"
    pid: int
    prev: list[str] = field(default_factory=list)
    prev_sizes: list[int] = field(default_factory=list)
    prev_seals: list[str] = field(default_factory=list)

    def check(self) -> None:
        _check_pid(self.op, "pid", self.pid)
        _check_prev(self.op, self.prev, self.prev_sizes, self.prev_seals)

    def expected_fds(self) -> int:
        return len(self.prev)


@dataclass(frozen=True)
class AgentRestoreRequest(_Request):
    """Restore the images given as descriptors (one per name in ``files``, in order),
    sealed by this cluster's agents for the caller's pod name, into the caller's pod. Then
    one descriptor per entry of ``inherit``: what the restored tree gets in place of that
    resource (CRIU's ``--inherit-fd``). ``files`` may name the files of a chain's levels by
    their paths (``parent/pages-1.img``), each with its seal in ``level_seals``."""

    op: ClassVar[str] = "restore"
    files: list[str]
    sizes: list[int]
    """Each file's size in bytes: the agent copies no more, and refuses a file of another
    size, or sizes past its budget, before it copies anything."""
    seal: str
    """The HMAC the dump's reply gave (hex)."""
    inherit: list[str]
    keep_tcp: bool = False
    """The images keep connections with their state (a dump with ``keep_tcp``)."""
    level_seals: list[str] = field(default_factory=list)
    """The seal of each file of ``files`` below the images' own (``parent/...``), in
    their order: each level is another dump's, whose files the agent sealed one by one."""

    def check(self) -> None:
        _check_strings(self.op, "files", self.files, _RESTORED_FILE, MAX_FILES)
        if not self.files:
            raise _refuse("restore: files is empty")
        if PARENT in self.files:
            raise _refuse(f"restore: files names {PARENT!r}, the directory of a chain's levels")
        _check_sizes(self.op, "sizes", self.sizes, len(self.files))
        if not isinstance(self.seal, str) or not _SEAL.fullmatch(self.seal):
            raise _refuse("restore: seal must be 64 hex digits")
        _check_strings(self.op, "inherit", self.inherit, _INHERITED, MAX_EXTERNALS)
        _check_bool(self.op, "keep_tcp", self.keep_tcp)
        _check_seals(self.op, "level_seals", self.level_seals, len(self.levels()))

    def levels(self) -> list[str]:
        """The files of ``files`` that are in levels below the images' own."""
        return [name for name in self.files if "/" in name]

    def expected_fds(self) -> int:
        return len(self.files) + len(self.inherit)


#: Every operation by name.
REQUESTS: dict[str, type[_Request]] = {
    cls.op: cls for cls in (HelloRequest, DumpRequest, PreDumpRequest, AgentRestoreRequest)
}


def parse_request(data: bytes, nfds: int) -> _Request:
    """The request in one datagram with ``nfds`` descriptors, or AgentRequestError."""
    if len(data) > MAX_MESSAGE:
        raise _refuse(f"a message of more than {MAX_MESSAGE} bytes")
    try:
        message = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise _refuse(f"not a JSON object ({type(exc).__name__})") from None
    if not isinstance(message, dict):
        raise _refuse("not a JSON object")
    unknown = sorted(set(message) - {"v", "op", "args"})
    if unknown:
        raise _refuse(f"unknown field {unknown[0]!r}")
    version = message.get("v")
    if type(version) is not int or version != VERSION:
        raise AgentRequestError(
            f"The node agent refused the request: protocol version {version!r}; this agent "
            f"speaks version {VERSION}.",
            hint=SAME_RELEASE_HINT,
        )
    op = message.get("op")
    cls = REQUESTS.get(op) if isinstance(op, str) else None
    if cls is None:
        raise _refuse(f"unknown operation {str(op)[:40]!r}")
    request = cls.parse(message.get("args", {}))
    # The first datagram carries at most MAX_FDS of them; the rest follow (receive_more).
    if nfds != min(request.expected_fds(), MAX_FDS):
        raise _refuse(f"{op}: {nfds} descriptors sent, {request.expected_fds()} expected")
    return request


def parse_copied(data: bytes) -> bool:
    """The caller's answer to ``frozen`` (a dump's ``frozen_copy``): whether its copies
    succeeded; anything but ``{"v": VERSION, "copied": true|false}`` is refused."""
    try:
        message = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        message = None
    if (
        not isinstance(message, dict)
        or set(message) != {"v", "copied"}
        or type(message["v"]) is not int
        or message["v"] != VERSION
        or type(message["copied"]) is not bool
    ):
        raise _refuse(
            f'dump: the answer to "frozen" must be {{"v": {VERSION}, "copied": true|false}}'
        )
    copied: bool = message["copied"]
    return copied


def encode_request(request: _Request) -> bytes:
    return json.dumps({"v": VERSION, "op": request.op, "args": request.to_json()}).encode()


# -- datagrams with descriptors -------------------------------------------------------------


def send(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    """Send ``message`` with ``fds``; more than :data:`MAX_FDS` go in further datagrams."""
    data = json.dumps({"v": VERSION, **message}).encode()
    if len(data) > MAX_MESSAGE:
        raise _refuse(f"a message of {len(data)} bytes (at most {MAX_MESSAGE})")
    fds = list(fds)
    first, rest = fds[:MAX_FDS], fds[MAX_FDS:]
    socket.send_fds(sock, [data], first) if first else sock.sendall(data)
    while rest:
        batch, rest = rest[:MAX_FDS], rest[MAX_FDS:]
        socket.send_fds(sock, [json.dumps({"v": VERSION, "more": len(batch)}).encode()], batch)


def receive(sock: socket.socket) -> tuple[bytes, list[int]]:
    """One datagram and its descriptors (b"" at the end of the connection). A datagram
    cut short (longer than MAX_MESSAGE) or with its descriptors cut is refused."""
    fds = array.array("i")
    data, ancdata, flags, _ = sock.recvmsg(MAX_MESSAGE, socket.CMSG_SPACE(MAX_FDS * fds.itemsize))
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    received = list(fds)
    if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
        for fd in received:
            _close(fd)
        raise _refuse("a message cut short (too long, or too many descriptors)")
    return data, received


def receive_more(sock: socket.socket, count: int) -> list[int]:
    """The ``count`` descriptors that follow a reply in ``more`` datagrams."""
    fds: list[int] = []
    while len(fds) < count:
        data, batch = receive(sock)
        fds += batch
        try:
            more = json.loads(data).get("more")
        except (ValueError, AttributeError):
            more = None
        if not batch or more != len(batch):
            for fd in fds:
                _close(fd)
            raise AgentUnavailableError(
                "The node agent's reply lost its descriptors.",
                hint="Retry; if it happens again, see the agent's log.",
            )
    return fds


def _close(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)
