"""The inner kernel: ipykernel, made ready to be dumped and restored by CRIU.

It runs as PID 1 of its own PID and time namespaces (started by the wrapper) and differs
from a plain ipykernel in seven ways, each needed for a clean CRIU image or a restore:

* its ZMQ sockets *connect* to endpoints that the wrapper binds in a private directory,
  so that while the wrapper is away (during a dump, after a restore elsewhere) messages
  queue inside the kernel and the sockets reconnect by themselves;
* what it sends to the wrapper is numbered and passes a gate that the wrapper holds while
  it lets go of the kernel, so no message is in flight when a connection ends
  (:mod:`kernel_wrapper.inkernel.gate`); its queues toward the wrapper have no limit, and
  it starts sending output only once the wrapper has subscribed to it;
* it has no heartbeat of its own (the wrapper answers heartbeats for the kernel's whole
  life) and keeps IPython's history in memory (a growing SQLite file would break restore);
* a watcher thread ends the kernel when its wrapper is gone, so no kernel is orphaned,
  also after a restore into a new wrapper: nobody reads its output pipe any more (a
  restore hands the kernel its new wrapper's pipe; see :func:`.lifeline.wrapper_alive`);
* a snapshot agent thread (kernel_wrapper.inkernel.agent) tells the wrapper before each dump what
  the snapshot holds (cells run, largest variables) and releases framework GPU caches
  before a GPU checkpoint;
* before each cell it runs the restore hooks of :mod:`kernel_snapshots` if the kernel was
  restored since the last cell (its TCP connections came back closed: docs/network.md);
* without root it declares its wrapper as its tracer (Yama's PR_SET_PTRACER), at start, in
  every child forked in Python, and again after each restore, so that CRIU, the wrapper's
  child, may seize it on nodes with ``kernel.yama.ptrace_scope = 1``
  (:mod:`jupyter_ext.core.isolation.confinement`).
"""

from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path
from typing import Any

import zmq
from ipykernel.iostream import IOPubThread
from ipykernel.kernelapp import IPKernelApp

import kernel_snapshots
from jupyter_ext.core.contents import CellLog
from jupyter_ext.core.isolation import mountns, privatetmp
from jupyter_ext.core.protocol.environment import ENV_INNER_DIR, ENV_OWN_PROC
from jupyter_ext.core.protocol.inner import AGENT_PORT, INNER_PORTS

from . import lifeline
from .agent import SnapshotAgent
from .gate import OutputGate

#: ZMQ reconnect interval (ms) toward the wrapper: short, so a restored kernel is back fast.
RECONNECT_IVL_MS = 10
RECONNECT_IVL_MAX_MS = 200
#: The channel "port" on which forked subprocesses send output (see ForkPipeToWrapper).
FORK_PIPE_PORT = INNER_PORTS["fork_pipe"]
#: How long the kernel waits at start for the wrapper to subscribe to its output, in ms.
SUBSCRIBE_TIMEOUT_MS = 30_000


class ForkPipeToWrapper(IOPubThread):
    """IOPub thread whose forked children send their output to the wrapper.

    ipykernel listens on a random loopback TCP port for output of forked subprocesses.
    A listening port in the image would have to be free again on restore (it is not
    while another kernel from the same snapshot runs); children connect to the wrapper
    over the runtime directory instead, like the kernel's own channels.
    """

    pipe_endpoint = ""

    def _setup_pipe_in(self) -> None:
        self._pipe_uuid = os.urandom(16)

    def _setup_pipe_out(self) -> tuple[zmq.Context[Any], zmq.Socket[Any]]:
        ctx: zmq.Context[Any] = zmq.Context()
        pipe_out = ctx.socket(zmq.PUSH)
        # ipykernel drops a child's output after 3 s undelivered; a dump can take longer
        # (the child waits, then delivers: the wrapper waits for children's connections to
        # end before it lets go of the kernel, kernel_wrapper.relay.Relay.disconnect).
        pipe_out.linger = -1
        pipe_out.connect(self.pipe_endpoint)
        return ctx, pipe_out


class SnapshotReadyKernelApp(IPKernelApp):
    """IPKernelApp whose channels connect to the wrapper instead of binding."""

    name = "snapshot-ready-kernel"

    def init_iopub(self, context: zmq.Context[Any]) -> None:
        self.iopub_socket = context.socket(zmq.XPUB)
        self.iopub_socket.linger = 1000
        self.iopub_port = self._try_bind_socket(self.iopub_socket, self.iopub_port)
        # An XPUB drops what it publishes before a subscription arrives: a numbered
        # message the wrapper would wait for in vain. Its subscription (left for ipykernel,
        # which answers it with a welcome) says the wrapper is there.
        self.iopub_socket.poll(SUBSCRIBE_TIMEOUT_MS, zmq.POLLIN)
        self.configure_tornado_logger()
        ForkPipeToWrapper.pipe_endpoint = f"ipc://{self.ip}-{FORK_PIPE_PORT}"
        self.iopub_thread = ForkPipeToWrapper(self.iopub_socket, pipe=True, session=self.session)
        self.iopub_thread.start()
        self.iopub_socket = self.iopub_thread.background_socket
        # Registered after the IOPub thread's own atexit stop, so it runs before it.
        atexit.register(self._stop_control_thread)

    gate = OutputGate()

    def _try_bind_socket(self, s: zmq.Socket[Any], port: int) -> int:
        # Nothing toward the wrapper is ever dropped or blocked by a queue limit while
        # the wrapper is away (an XPUB drops past its limit, a ROUTER too).
        s.setsockopt(zmq.SNDHWM, 0)
        s.setsockopt(zmq.RCVHWM, 0)
        self.gate.number({v: k for k, v in INNER_PORTS.items()}[port], s)
        if s.type == zmq.ROUTER:
            # The wrapper's end always has the same routing id: when it comes back (after a
            # dump, a restore) while our end still holds the old connection, the new one
            # must win; by default a ROUTER refuses it, and what it carried is lost.
            s.setsockopt(zmq.ROUTER_HANDOVER, 1)
        s.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
        s.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
        s.connect(f"ipc://{self.ip}-{port}")
        return port

    cells = CellLog()

    def init_sockets(self) -> None:
        super().init_sockets()
        assert self.context is not None
        self._agent_endpoint = f"ipc://{self.ip}-{AGENT_PORT}"

    def init_control(self, context: zmq.Context[Any]) -> None:
        super().init_control(context)
        # ipykernel points its debugger's shell socket at LAST_ENDPOINT, which for a
        # connecting socket is the wrapper: that would inject messages into the wrapper.
        self.debug_shell_socket.close(linger=0)
        self.debug_shell_socket = context.socket(zmq.DEALER)

    def _stop_control_thread(self) -> None:
        """Stop the control thread while the IOPub thread still runs.

        At exit, ipykernel stops the IOPub thread first (its atexit handler was registered
        last); a control thread still flushing output after the shutdown request then
        blocks forever waking the stopped IOPub thread, and the kernel never exits (seen
        in tests after interrupts, py-spy: ``IOPubThread.schedule`` -> ``Socket.send``).
        """
        if self.control_thread and self.control_thread.is_alive():
            self.control_thread.stop()
            self.control_thread.join()

    def init_heartbeat(self) -> None:
        """The wrapper answers heartbeats; the inner kernel has none."""
        self.heartbeat = None

    def init_shell(self) -> None:
        super().init_shell()
        # pre_execute, not pre_run_cell: silent executions (variable inspectors) use the
        # connections too. The callback never raises (kernel_snapshots reports failures).
        assert self.shell is not None
        self.shell.events.register("pre_execute", kernel_snapshots.run_pending_hooks)
        self.shell.events.register("pre_run_cell", self.cells.pre_run_cell)
        self.shell.events.register("post_run_cell", self.cells.post_run_cell)
        assert self.context is not None
        SnapshotAgent(self.context, self._agent_endpoint, self.shell, self.cells, self.gate).start()


def main() -> None:
    os.setsid()  # CRIU wants the root task to lead its own session.
    if os.environ.pop(ENV_OWN_PROC, None) == "1":
        mountns.mount_own_proc()
        privatetmp.bind_temp_dir()  # a copy beside this kernel can get a private view
    runtime_dir = Path(os.environ.pop(ENV_INNER_DIR))
    kernel_snapshots._install(runtime_dir)
    lifeline.start(runtime_dir)
    SnapshotReadyKernelApp.launch_instance(
        argv=[
            *sys.argv[1:],
            "--HistoryManager.hist_file=:memory:",
            # A parent handle of 1 means "managed": no banner, and no parent poller.
            "--IPKernelApp.parent_handle=1",
        ]
    )


if __name__ == "__main__":
    main()
