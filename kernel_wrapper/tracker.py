"""What the wrapper knows of its kernel from the messages the relay passes, and the cell a
restored kernel resumes.

The relay (:mod:`kernel_wrapper.relay`) shows the tracker every message it forwards. From
them the tracker keeps what the wrapper must know without asking the kernel: activity,
execution state, kernel info and the execute_requests not answered yet (the cell running,
which a snapshot records). After a restore it carries the cell the kernel resumes to
clients that connect later: its "busy" status, what it printed, its reply, and a
kernel_info_reply while the kernel cannot answer one itself.
"""

from __future__ import annotations

import collections
import contextlib
import json
import secrets
import time
from collections.abc import Callable
from typing import Any

from jupyter_client.session import DELIM, Session

from jupyter_ext.core.contents import CellLog

from .channels import Route

Send = Callable[[Route, list[bytes]], None]
"""How the tracker sends a message of its own (the relay's ``send``)."""

#: Requests that may change the kernel's state (cell checkpoints count them: one sent
#: during a checkpoint's preparation cuts it short; kernel_wrapper/checkpoints.py).
CHANGING_REQUESTS = (b'"execute_request"', b'"comm_msg"', b'"comm_open"', b'"comm_close"')

#: What a malformed message can raise while its frames are read.
_MALFORMED = (ValueError, IndexError, KeyError, TypeError)


class KernelTracker:
    """The kernel as the messages that pass show it; ``send`` sends what the tracker
    answers or publishes itself, signed with ``session``."""

    #: execute_requests remembered without a reply (replies lost with a killed kernel).
    MAX_EXECUTING = 1000
    #: Shell clients remembered (routing ids of recent requests), for a resumed reply.
    MAX_SHELL_PEERS = 64
    #: Messages of a resumed request kept for clients that subscribe later.
    MAX_RESUMED_OUTPUT = 10_000
    #: Cells remembered since the last snapshot (the newest).
    MAX_CELLS_SINCE = 50
    #: Characters of a cell's first line remembered.
    FIRST_LINE_CHARS = 120
    #: Metadata key of a message published again for a later subscriber: the original
    #: message's id (a replay has its own id, since clients refuse a repeated signature).
    REPLAY_OF = "kernel_snapshots_replay_of"

    def __init__(self, session: Session, send: Send) -> None:
        self.session = session
        self.send = send
        self.kernel_info: dict[str, Any] = {}
        self.execution_state = "starting"
        self.last_activity = time.time()
        self.executions_since_snapshot = 0
        self.longest_cell_since_snapshot = 0.0
        """Seconds of the longest cell that finished since the last snapshot: the server's
        long-cell policy snapshots after one past its threshold."""
        self.cells: CellLog | None = None
        """The cells a kernel without a snapshot agent ran (one behind the bridge), for
        the next snapshot's record; None for ipykernel, whose agent keeps its own."""
        self.cells_since_snapshot: collections.deque[dict[str, Any]] = collections.deque(
            maxlen=self.MAX_CELLS_SINCE
        )
        """The cells the kernel began since the last snapshot (``execution_count``,
        ``first_line``): what a restore of that snapshot would not bring back."""
        self.changed: Callable[[], None] = lambda: None
        """Called when a cell begins and when a snapshot or restore clears the cells (the
        wrapper keeps its journal with it: jupyter_ext.core.protocol.KernelJournal)."""
        self.shutdown_requested = False
        """Whether a shutdown_request went to the kernel: its end is then on purpose (a
        lazy restore it cuts short has not failed)."""
        self.resumed_request: dict[str, Any] | None = None
        """The request a restored kernel was running at its snapshot, while it still runs."""
        self.changing_requests = 0
        """Requests passed to the kernel that may change its state (CHANGING_REQUESTS)."""
        self.on_cell: Callable[[str | None, int | None], None] | None = None
        """Called with (cell id, execution count) when an execute_request is answered."""
        self.on_idle: Callable[[], None] | None = None
        """Called when the kernel is idle with no execute_request left unanswered (cell
        checkpoints start then)."""
        self._executing: collections.OrderedDict[str, dict[str, Any]] = collections.OrderedDict()
        """execute_requests the kernel got and has not answered, oldest (running) first:
        {"header", "cell_id", "execution_count"} by msg_id."""
        self._resumed_output: collections.deque[list[bytes]] = collections.deque(
            maxlen=self.MAX_RESUMED_OUTPUT
        )
        """What the resumed request published since the restore, for clients yet to come."""
        self._shell_peers: collections.OrderedDict[tuple[bytes, ...], None] = (
            collections.OrderedDict()
        )
        """Routing ids of recent shell clients, newest last."""
        self._cell_code: dict[str, str] = {}
        """With ``cells``: the code of cells (not silent execute_requests) that have not
        begun; ``_cell_running``: the one that has."""
        self._cell_running: str | None = None

    # ------------------------------------------------------------------ what passes

    def observe(self, name: str, frames: list[bytes], reply: bool) -> None:
        """Keep what the wrapper must know without the kernel: activity, state, kernel info."""
        try:
            at = frames.index(DELIM)
        except ValueError:
            return
        header = frames[at + 2] if len(frames) > at + 2 else b""
        if name == "shell" and not reply and any(kind in header for kind in CHANGING_REQUESTS):
            self.changing_requests += 1
        if name == "shell" and not reply and b'"execute_request"' in header:
            self.last_activity = time.time()
            self.executions_since_snapshot += 1
            with contextlib.suppress(*_MALFORMED):
                self._track_execute(frames[at + 2], frames[at + 4], frames[at + 5])
        elif name == "shell" and reply and b'"execute_reply"' in header:
            with contextlib.suppress(*_MALFORMED):
                self._finished(json.loads(frames[at + 3])["msg_id"], frames[at + 5])
        elif name == "iopub" and b'"execute_input"' in header:
            with contextlib.suppress(*_MALFORMED):
                self._started(json.loads(frames[at + 3])["msg_id"], frames[at + 5])
        elif name == "iopub" and b'"status"' in header:
            with contextlib.suppress(ValueError, IndexError, KeyError):
                content = json.loads(frames[at + 5])
                self.execution_state = content["execution_state"]
                self.last_activity = time.time()
                self._maybe_idle()
        elif name == "control" and not reply and b'"shutdown_request"' in header:
            self.shutdown_requested = True
        elif reply and b'"kernel_info_reply"' in header:
            with contextlib.suppress(ValueError, IndexError):
                self.kernel_info = json.loads(frames[at + 5])

    def _track_execute(self, header: bytes, metadata: bytes, content: bytes) -> None:
        """Remember an execute_request the kernel got, for the snapshot's record of the
        running cell (and the cell a restored kernel resumes), and its first line."""
        parsed = json.loads(header)
        cell_id = json.loads(metadata).get("cellId") if metadata else None
        request = json.loads(content)
        self._executing[parsed["msg_id"]] = {
            "header": parsed,
            "cell_id": cell_id if isinstance(cell_id, str) else None,
            "execution_count": None,
            "first_line": self._first_line(request.get("code")),
        }
        if self.cells is not None and not request.get("silent"):  # a variable inspector's
            self._cell_code[parsed["msg_id"]] = str(request.get("code", ""))
        while len(self._executing) > self.MAX_EXECUTING:
            self._cell_code.pop(self._executing.popitem(last=False)[0], None)

    def _started(self, msg_id: str, content: bytes) -> None:
        """The kernel began the request ``msg_id`` (its execute_input)."""
        parsed = json.loads(content)
        running = self._executing.get(msg_id)
        if running is not None:
            running["execution_count"] = parsed.get("execution_count")
            running["started"] = time.monotonic()  # queued cells wait before it
            self._cell_started(msg_id)
        self.cells_since_snapshot.append(
            {
                "execution_count": parsed.get("execution_count"),
                "first_line": self._first_line(parsed.get("code")),
            }
        )
        self.changed()

    def _first_line(self, code: object) -> str:
        text = code if isinstance(code, str) else ""
        first = next((line for line in text.splitlines() if line.strip()), "")
        return first.rstrip()[: self.FIRST_LINE_CHARS]

    def cells_since(self) -> list[dict[str, Any]]:
        """The cells begun since the last snapshot, and the one running if the kernel died
        before its start was heard (its execute_input lost with the kernel)."""
        cells = list(self.cells_since_snapshot)
        running = next(iter(self._executing.values()), None)
        if running is not None and running["execution_count"] is None and "first_line" in running:
            cells.append({"execution_count": None, "first_line": running["first_line"]})
        return cells

    def _finished(self, msg_id: str, content: bytes) -> None:
        """The kernel answered the request ``msg_id`` (its execute_reply)."""
        finished = self._executing.pop(msg_id, None)
        if finished is not None and "started" in finished:
            seconds = time.monotonic() - finished.pop("started")
            self.longest_cell_since_snapshot = max(self.longest_cell_since_snapshot, seconds)
        if self.resumed_request and self.resumed_request["header"]["msg_id"] == msg_id:
            self.resumed_request = None
            self._resumed_output.clear()
        self._cell_started(msg_id)  # its execute_input may come after the reply
        if self.cells is not None and self._cell_running == msg_id:
            parsed = json.loads(content)
            self.cells.finished(parsed.get("execution_count"), parsed.get("status") == "ok")
            self._cell_running = None
        if finished is not None and self.on_cell is not None:
            self.on_cell(finished["cell_id"], finished["execution_count"])
        self._maybe_idle()  # the reply may pass after the idle status (another pump)

    def _cell_started(self, msg_id: str) -> None:
        """Log the cell ``msg_id`` as begun, once (with ``cells``)."""
        code = self._cell_code.pop(msg_id, None)
        if self.cells is not None and code is not None:
            self.cells.started(code)
            self._cell_running = msg_id

    def _maybe_idle(self) -> None:
        if self.execution_state == "idle" and not self._executing and self.on_idle is not None:
            self.on_idle()

    def running_request(self) -> dict[str, Any] | None:
        """The execute_request the kernel is running (the oldest without a reply)."""
        if not self._executing:
            return None
        running = dict(next(iter(self._executing.values())))
        running.pop("started", None)
        running.pop("first_line", None)
        return running

    def snapshot_taken(self) -> None:
        """A snapshot (or a restore) holds everything up to now."""
        self.executions_since_snapshot = 0
        self.longest_cell_since_snapshot = 0.0
        self.cells_since_snapshot.clear()
        self.changed()

    # ------------------------------------------------------------------ a resumed cell

    def resume_request(self, running: dict[str, Any] | None) -> None:
        """After a restore: the request the kernel was running at its snapshot goes on.

        Its client may be gone (another node, a new server): a new one must learn that the
        kernel is busy with it, and must not wait for the kernel_info_reply that jupyter_server
        asks for on the shell channel before it opens a websocket (the kernel answers shell
        only once the cell ends). So, while that request runs, the wrapper answers
        kernel_info itself and announces "busy" for it to every new subscriber.
        """
        self._executing.clear()
        self._cell_code.clear()
        self._resumed_output.clear()
        self.resumed_request = running
        if running is not None:
            self._executing[running["header"]["msg_id"]] = running
            self.announce_resumed()

    def announce_resumed(self) -> None:
        """Publish a "busy" status whose parent is the resumed request."""
        if self.resumed_request is None:
            return
        msg = self.session.msg(
            "status", {"execution_state": "busy"}, parent={"header": self.resumed_request["header"]}
        )
        frames = self.session.serialize(msg)
        self.execution_state = "busy"
        self.send(("server", "iopub"), frames)

    def replays(self) -> list[list[bytes]]:
        """What the resumed request published so far, as new messages for a new subscriber
        (unsigned: the relay signs them)."""
        return [self._replay(kept) for kept in self._resumed_output]

    def _replay(self, frames: list[bytes]) -> list[bytes]:
        """A kept message of the resumed request as a new message (own id; the relay signs
        it) that names the original in its metadata, so a client shows it once."""
        at = frames.index(DELIM)
        header = json.loads(frames[at + 2])
        metadata = json.loads(frames[at + 4]) if frames[at + 4] else {}
        metadata[self.REPLAY_OF] = header["msg_id"]
        header["msg_id"] = secrets.token_hex(16)
        fresh = [*frames[: at + 2], json.dumps(header).encode(), frames[at + 3]]
        return [*fresh, json.dumps(metadata).encode(), *frames[at + 5 :]]

    def kernel_sent(self, name: str, frames: list[bytes]) -> None:
        """A message of the kernel on its way out (signed): while a resumed request runs,
        keep what it publishes and copy its reply (see below)."""
        if self.resumed_request is None:
            return
        if name == "shell":
            self._copy_resumed_reply(frames)
        elif name in ("iopub", "fork_pipe"):
            self._keep_resumed_output(frames)

    def _keep_resumed_output(self, frames: list[bytes]) -> None:
        """Keep what the resumed request publishes: a client of the restored kernel
        subscribes only after the restore (the notebook connects once the restore job is
        done, on another node too), and an XPUB drops what it published before; each new
        subscriber gets it again (see _replay)."""
        assert self.resumed_request is not None
        with contextlib.suppress(*_MALFORMED):
            at = frames.index(DELIM)
            parent = json.loads(frames[at + 3])
            if parent.get("msg_id") == self.resumed_request["header"]["msg_id"]:
                self._resumed_output.append(frames)

    def _copy_resumed_reply(self, frames: list[bytes]) -> None:
        """The reply of a resumed request goes to its own client, which is gone after a
        restore elsewhere: copy it to every shell client that asked something since."""
        assert self.resumed_request is not None
        at = frames.index(DELIM)
        with contextlib.suppress(*_MALFORMED):
            parent = json.loads(frames[at + 3])
            if parent["msg_id"] != self.resumed_request["header"]["msg_id"]:
                return
            for peer in self._shell_peers:
                if list(peer) != frames[:at]:
                    self.send(("server", "shell"), [*peer, *frames[at:]])

    def answer_kernel_info(self, name: str, frames: list[bytes]) -> bool:
        """For each request from a client: remember who asks on shell, and answer a shell
        kernel_info_request from the recorded kernel info while a resumed cell runs (see
        resume_request). False: the kernel gets the request."""
        if name != "shell":
            return False
        at = frames.index(DELIM)
        peer = tuple(frames[:at])
        self._shell_peers[peer] = None
        self._shell_peers.move_to_end(peer)
        while len(self._shell_peers) > self.MAX_SHELL_PEERS:
            self._shell_peers.popitem(last=False)
        if self.resumed_request is None or not self.kernel_info:
            return False
        if b'"kernel_info_request"' not in frames[at + 2]:
            return False
        with contextlib.suppress(ValueError):
            parent = {"header": json.loads(frames[at + 2])}
            reply = self.session.msg("kernel_info_reply", self.kernel_info, parent=parent)
            self.send(("server", "shell"), self.session.serialize(reply, ident=frames[:at]))
            return True
        return False
