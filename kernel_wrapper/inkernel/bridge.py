"""The bridge: any Jupyter kernel (IRkernel, xeus kernels, bash, Julia ...) as the inner
kernel, unchanged.

ipykernel is made to *connect* its channels to the wrapper (:mod:`.inner`). Other kernels
cannot be changed, and every one *binds* the endpoints its connection file names (IRkernel
through pbdZMQ, xeus through its own C++ stack). A wrapper connected to them could not stay
connected across a dump (CRIU refuses a unix connection to a process outside the dumped
tree) and would lose what the kernel sent while it was away (a ROUTER drops replies to a
peer it does not know, a PUB drops output nobody subscribes to). So the bridge runs inside
the kernel's tree, as its root (PID 1 of its namespace with root), and:

* starts the kernel with a connection file of ``ipc`` endpoints in a private directory
  (0700) and a key of its own, connects to each endpoint once the kernel has bound it,
  then removes the endpoints' files: nobody else can reach the kernel any more,
  and the connections, both ends inside the tree, are dumped and restored by CRIU with
  what they hold (it binds the listening sockets, whose files are gone, and removes them
  again itself, on any machine);
* connects to the wrapper exactly as ipykernel's sockets do (so they queue while the
  wrapper is away during a dump, and reconnect by themselves after a restore), and passes
  messages both ways: requests, which the wrapper passes unsigned, signed with the
  kernel's key; the kernel's messages as they are (the wrapper signs them);
* reaps orphans (PSOCK workers that R starts in the background), ends with the kernel
  (its exit status), and ends the kernel when the wrapper is gone (:mod:`.lifeline`).

A kernel that does not bind the ``ipc`` endpoints its connection file names (one that
only knows TCP, listening on ports instead, or one that exits at start) cannot run this
way: the bridge says so, naming what it does listen on, in :data:`REFUSED_FILE` of the
runtime directory and on stderr, and exits with :data:`EXIT_REFUSED`; the wrapper then
answers every cell with that reason instead of having the server restart it in vain
(docs/kernels.md).

Run by the wrapper as ``python -m kernel_wrapper.inkernel.bridge CONNECTION_FILE -- ARGV``.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from jupyter_ext.core import proctree
from jupyter_ext.core.carried import netports, sockdiag
from jupyter_ext.core.isolation import mountns, privatetmp
from jupyter_ext.core.protocol.environment import ENV_INNER_DIR, ENV_OWN_PROC
from jupyter_ext.core.protocol.inner import INNER_PORTS, REFUSED_FILE

from . import lifeline

#: The routing id of every bridge socket toward the kernel: the same on shell and stdin,
#: so an input_request the kernel routes to its shell request's sender reaches us.
BRIDGE_ROUTING_ID = b"kernel-snapshot-bridge"
#: The channels the bridge relays (the wrapper answers heartbeats itself).
CHANNELS = ("shell", "stdin", "control", "iopub")
REQUESTS = ("shell", "stdin", "control")
#: ZMQ reconnect interval (ms) toward the wrapper, as ipykernel's (kernel_wrapper.inkernel.inner).
RECONNECT_IVL_MS = 10
RECONNECT_IVL_MAX_MS = 200
#: How long a kernel may take to bind its endpoints before the bridge gives up on it.
BIND_TIMEOUT = 120.0
#: How often the bridge looks whether the kernel has bound its endpoints.
BIND_POLL = 0.01
#: How long a kernel may listen on TCP, none of its endpoints bound, before the bridge
#: takes it for one that ignores the ipc transport (a kernel may open a port of its own
#: before it binds its channels).
TCP_GRACE = 3.0
#: The bridge's exit status when the kernel cannot take the endpoints it needs.
EXIT_REFUSED = 78
DELIM = b"<IDS|MSG>"


class Refused(Exception):
    """The kernel cannot take what the wrapper needs; the message says what and why."""


def endpoint_path(connection: dict[str, Any], name: str) -> str | None:
    """Where the kernel bound ``name``'s endpoint: ``IP-PORT`` (the Jupyter convention
    for ``ipc``, ipykernel's, IRkernel's, xeus's) or ``IP:PORT`` (some kernels use the TCP
    separator for ipc too); None while neither is a socket."""
    for sep in "-:":
        path = f"{connection['ip']}{sep}{connection[f'{name}_port']}"
        try:
            if stat.S_ISSOCK(os.stat(path).st_mode):
                return path
        except OSError:
            continue
    return None


def _listening_elsewhere(pid: int) -> list[str]:
    """The TCP ports the kernel's tree listens on (a kernel that ignored ``transport``)."""
    pids = proctree.descendants(pid)
    ports = netports.bound_ports(sockdiag.TreeSockets.of(pids), pid)
    return [port.describe() for port in ports if port.proto == "tcp"]


def wait_for_endpoints(
    kernel: subprocess.Popen[bytes], connection: dict[str, Any], timeout: float = BIND_TIMEOUT
) -> dict[str, str]:
    """The paths of the kernel's endpoints once it has bound all of them (and its
    heartbeat's, removed with them). Raises :class:`Refused` when it ends first, when it
    listens on TCP for :data:`TCP_GRACE` seconds without binding any of them, or when it
    binds nothing in ``timeout``."""
    names = [*CHANNELS, "hb"]
    deadline = time.monotonic() + timeout
    next_look = 0.0
    tcp_since: float | None = None
    while True:
        found = {name: endpoint_path(connection, name) for name in names}
        if all(found.values()):
            return {name: str(path) for name, path in found.items()}
        code = kernel.poll()
        if code is not None:
            raise Refused(
                f"The kernel exited (status {code}) before it bound the ipc endpoints its "
                f"connection file names ({connection['ip']}-N): it does not take the ipc "
                "transport a snapshot kernel needs, or it failed to start. Its own output, in "
                "the server's log just before this, says which."
            )
        now = time.monotonic()
        if now >= next_look and not any(found.values()):
            next_look = now + 0.5
            tcp = _listening_elsewhere(kernel.pid)
            tcp_since = (tcp_since or now) if tcp else None
            if tcp and now - (tcp_since or now) >= TCP_GRACE:
                raise Refused(
                    "This kernel does not take the ipc transport that its connection file "
                    f"names: it listens on {', '.join(tcp)} instead. A snapshot kernel needs "
                    "ipc endpoints in a private directory: TCP ports in a snapshot must be free "
                    "again wherever it is restored, and anyone on the machine could connect "
                    "to them."
                )
        if now > deadline:
            missing = [name for name, path in found.items() if not path]
            raise Refused(
                f"This kernel did not bind its {', '.join(missing)} endpoint(s) "
                f"({connection['ip']}-N) within {timeout:.0f} s, and listens on no TCP port "
                "either: it does not seem to take the connection file a snapshot kernel "
                "gives it."
            )
        time.sleep(BIND_POLL)


class Bridge:
    """The sockets between the kernel (``kernel``: its endpoints' paths) and the wrapper
    (``wrapper_dir``: the runtime directory as the kernel's tree names it), and the thread
    that passes messages between them; requests are signed with ``key``."""

    def __init__(
        self,
        kernel: dict[str, str],
        wrapper_dir: str,
        key: bytes,
        process: subprocess.Popen[bytes],
    ) -> None:
        self.key = key
        self.context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.back: dict[str, zmq.Socket[bytes]] = {}
        self.front: dict[str, zmq.Socket[bytes]] = {}
        monitors = []
        for name in CHANNELS:
            sock = self.context.socket(zmq.SUB if name == "iopub" else zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RCVHWM, 0)
            if name == "iopub":
                sock.setsockopt(zmq.SUBSCRIBE, b"")
            else:
                sock.setsockopt(zmq.ROUTING_ID, BRIDGE_ROUTING_ID)
            monitors.append(sock.get_monitor_socket(zmq.EVENT_CONNECTED))
            sock.connect(f"ipc://{kernel[name]}")
            self.back[name] = sock
        self._wait_connected(monitors, process)
        for name in CHANNELS:
            self.back[name].disable_monitor()
        for monitor in monitors:
            monitor.close(linger=0)
        for name in CHANNELS:
            # As ipykernel's sockets in kernel_wrapper.inkernel.inner: they connect, queue
            # while the wrapper is away (nothing is dropped: no high-water mark), and a
            # ROUTER hands its peer over to the wrapper's end when it comes back.
            sock = self.context.socket(zmq.PUB if name == "iopub" else zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 1000)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.RECONNECT_IVL, RECONNECT_IVL_MS)
            sock.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS)
            if name != "iopub":
                sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
            sock.connect(f"ipc://{wrapper_dir}/ch-{INNER_PORTS[name]}")
            self.front[name] = sock
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._pump, name="bridge", daemon=True)

    @staticmethod
    def _wait_connected(
        monitors: list[zmq.Socket[bytes]], process: subprocess.Popen[bytes], timeout: float = 30.0
    ) -> None:
        deadline = time.monotonic() + timeout
        for monitor in monitors:  # each says only EVENT_CONNECTED
            while not monitor.poll(100):
                if process.poll() is not None:
                    return  # the kernel ended: the caller sees it, and its output says why
                if time.monotonic() > deadline:
                    raise Refused(
                        "The bridge could not connect to the kernel's endpoints within "
                        f"{timeout:.0f} s although the kernel bound them."
                    )
            recv_monitor_message(monitor)

    def sign(self, frames: list[bytes]) -> list[bytes]:
        """A request from the wrapper (unsigned), signed with the kernel's key."""
        try:
            at = frames.index(DELIM)
        except ValueError:
            return frames
        mac = hmac.new(self.key, digestmod=hashlib.sha256)
        for part in frames[at + 2 : at + 6]:
            mac.update(part)
        return [*frames[: at + 1], mac.hexdigest().encode(), *frames[at + 2 :]]

    def _pump(self) -> None:
        poller = zmq.Poller()
        for sock in [*self.front.values(), *self.back.values()]:
            if sock.type != zmq.PUB:
                poller.register(sock, zmq.POLLIN)
        routes = {self.back[name]: self.front[name] for name in CHANNELS}
        requests = {self.front[name]: self.back[name] for name in REQUESTS}
        while not self.stopping.is_set():
            for sock, _ in poller.poll(100):
                self._pass(sock, routes, requests)
        # The kernel ended: pass on what it sent last (its shutdown_reply), then let the
        # sockets flush for up to their linger.
        for sock in self.back.values():
            self._pass(sock, routes, requests)
        self.context.destroy(linger=1000)

    def _pass(
        self,
        sock: zmq.Socket[bytes],
        routes: dict[zmq.Socket[bytes], zmq.Socket[bytes]],
        requests: dict[zmq.Socket[bytes], zmq.Socket[bytes]],
    ) -> None:
        """Everything waiting on ``sock``, passed on."""
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if sock in requests:
                requests[sock].send_multipart(self.sign(frames))
            else:
                routes[sock].send_multipart(frames)


def _ignore(_signum: int, _frame: object) -> None:
    """SIGINT reaches the kernel's whole process group: the kernel handles it; the bridge
    only must not die of it. (A handler, not SIG_IGN: exec resets a handler, so the
    kernel it starts does not ignore interrupts.)"""


def refuse(runtime_dir: Path, reason: str) -> int:
    """Say why the kernel cannot run as a snapshot kernel, where the wrapper finds it."""
    print(f"kernel_wrapper: {reason}", file=sys.stderr, flush=True)
    (runtime_dir / REFUSED_FILE).write_text(reason)
    return EXIT_REFUSED


def python_argv(argv: list[str]) -> list[str]:
    """``argv`` with a bare ``python``, ``python3`` or ``python3.N`` as its program made
    this interpreter, as jupyter_client does for the kernelspecs it starts (xeus-python's
    says ``python3.11``, which on PATH may be another Python than the server's)."""
    names = {"python", f"python{sys.version_info[0]}", "python{}.{}".format(*sys.version_info)}
    return [sys.executable, *argv[1:]] if argv and argv[0] in names else list(argv)


def run(connection_file: Path, argv: list[str]) -> int:
    """Start the kernel, bridge it, and return its exit status once it ends."""
    os.setsid()  # CRIU wants the root task to lead its own session.
    if os.environ.pop(ENV_OWN_PROC, None) == "1":
        mountns.mount_own_proc()
        privatetmp.bind_temp_dir()  # a copy beside this kernel can get a private view
    runtime_dir = Path(os.environ.pop(ENV_INNER_DIR))
    proctree.set_subreaper(True)  # without a PID namespace of our own: orphans stay ours
    signal.signal(signal.SIGINT, _ignore)
    connection = json.loads(connection_file.read_text())
    tracer = None if os.getpid() == 1 else lambda: lifeline.declare_wrapper_as_tracer(runtime_dir)
    kernel = subprocess.Popen(python_argv(argv), stdin=subprocess.DEVNULL, preexec_fn=tracer)
    lifeline.start(runtime_dir)
    try:
        endpoints = wait_for_endpoints(kernel, connection)
        bridge = Bridge(endpoints, str(runtime_dir), connection["key"].encode(), kernel)
    except Refused as exc:
        kernel.kill()
        kernel.wait()
        return refuse(runtime_dir, str(exc))
    if kernel.poll() is not None:
        return kernel.wait()  # it ended as it was bridged: its own output says why
    for path in endpoints.values():
        os.unlink(path)
    os.rmdir(os.path.dirname(connection["ip"]))
    connection_file.unlink()
    bridge.thread.start()
    code = _reap_until(kernel.pid)
    bridge.stopping.set()
    bridge.thread.join(5)
    return code


def _reap_until(pid: int) -> int:
    """Reap every child (orphans adopted as PID 1 or subreaper too) until ``pid`` ends;
    its exit status."""
    while True:
        try:
            done, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return 1
        if done == pid:
            return os.waitstatus_to_exitcode(status)


def main() -> None:
    args = sys.argv[1:]
    if len(args) < 3 or args[1] != "--":
        sys.exit("usage: python -m kernel_wrapper.inkernel.bridge CONNECTION_FILE -- ARGV...")
    code = run(Path(args[0]), args[2:])
    sys.stdout.flush()
    os._exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main()
