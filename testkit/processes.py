"""Real processes for the tests and the benchmarks (one harness for both, not shipped):
a snapshot kernel (`python -m kernel_wrapper`) with a jupyter_client; moto's S3 server
(:class:`MotoServer`); ``jupyter server`` with the extension as a separate process in its
own Jupyter directories (:class:`ServerProcess`, a REST :class:`Endpoint`), and its
kernels' websockets as JupyterLab opens them (:func:`ws_connect`, :func:`execute_request`)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jupyter_client.blocking.client import BlockingKernelClient
from jupyter_client.connect import write_connection_file

from jupyter_ext.core import proctree
from jupyter_ext.core.criu import Criu
from jupyter_ext.core.errors import SnapshotError
from jupyter_ext.core.lazypages import Into, LazySettings, lazy_plan
from jupyter_ext.core.manifest import Manifest
from jupyter_ext.core.protocol.control import (
    EXIT_PORT_IN_USE,
    PORT_ATTEMPTS,
    RestoreRequest,
    WrapperClient,
    WrapperInfo,
)
from jupyter_ext.core.protocol.environment import ENV_AWAIT_RESTORE, ENV_KEY
from jupyter_ext.core.protocol.progress import ProgressCallback
from jupyter_ext.core.store.keys import EnvKeySource
from jupyter_ext.serverclient import ServerClient

if TYPE_CHECKING:
    from tornado.websocket import WebSocketClientConnection

#: Seconds without a heartbeat echo before the test client calls the kernel dead.
HEARTBEAT_GRACE = 10.0


@functools.cache
def _lazy_pages() -> bool:
    """Whether this machine's CRIU restores with lazy pages (asked once)."""
    try:
        return Criu.locate().supports_lazy_pages()[0]
    except SnapshotError:
        return False


def _gone(pid: int) -> bool:
    """Whether no thread of ``pid`` is left but zombies: its files and sockets are closed
    (proctree.is_alive says a killed process no longer runs a moment before: its ports
    are still bound then)."""
    try:
        threads = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    for thread in threads:
        try:
            stat = Path(f"/proc/{pid}/task/{thread}/stat").read_text()
        except OSError:
            continue  # ended while looked at
        if stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
            return False
    return True


class KernelProcess:
    """One snapshot kernel (``python -m kernel_wrapper``) and a client connected to it."""

    def __init__(
        self,
        workdir: Path,
        *,
        restore_from: Path | None = None,
        on_inner_death: str = "wait",
        extra_args: list[str] | None = None,
        env: dict[str, str] | None = None,
        prefix: Sequence[str] = (),
        preexec_fn: Callable[[], None] | None = None,
        kernel_argv: list[str] | None = None,
    ) -> None:
        """``prefix``, ``preexec_fn``: how the wrapper is started elsewhere (in a stand-in
        pod: :meth:`testkit.agentpods.FakePod.argv`). ``kernel_argv``: another kernel's
        kernelspec argv (``{connection_file}`` in it), run behind the wrapper's bridge
        instead of its ipykernel."""
        workdir.mkdir(parents=True, exist_ok=True)
        self._preexec_fn = preexec_fn
        self.kernel_argv = kernel_argv or []
        argv = [*prefix, sys.executable, "-m", "kernel_wrapper", "--on-inner-death", on_inner_death]
        argv += extra_args or []
        for attempt in range(PORT_ATTEMPTS):
            try:
                self._start(workdir, argv, env, restore_from)
                break
            except RuntimeError:
                # The free ports jupyter_client picked can be taken before the wrapper
                # binds them (an outgoing connection of another test's kernel takes one as
                # its local port): the wrapper says so, and the next try picks new ports.
                if self.process.returncode != EXIT_PORT_IN_USE or attempt == PORT_ATTEMPTS - 1:
                    raise
        self.control = WrapperClient(WrapperInfo.for_connection_file(self.connection_file).control)

    def _start(
        self,
        workdir: Path,
        argv: list[str],
        env: dict[str, str] | None,
        restore_from: Path | None,
    ) -> None:
        self.connection_file = Path(
            write_connection_file(
                str(workdir / f"kernel-{uuid.uuid4()}.json"), key=uuid.uuid4().hex.encode()
            )[0]
        )
        self.log_path = workdir / f"{self.connection_file.stem}.log"
        self._log = self.log_path.open("wb")
        environ = {**os.environ, **(env or {})}
        self.lazy_settings = LazySettings.from_env(environ)
        """The lazy-restore settings the wrapper has (for its own restores)."""
        marker = workdir / f"await-restore-{uuid.uuid4().hex}"
        if restore_from is not None:  # as the server restores into a new kernel
            marker.touch()
            environ[ENV_AWAIT_RESTORE] = str(marker)
        inner = [
            arg.replace("{connection_file}", str(self.connection_file)) for arg in self.kernel_argv
        ]
        self.process = subprocess.Popen(
            [*argv, "-f", str(self.connection_file), *(["--", *inner] if inner else [])],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=environ,
            cwd=workdir,
            preexec_fn=self._preexec_fn,
        )
        if restore_from is not None:
            try:
                asyncio.run(self._restore(restore_from))
            except SnapshotError as exc:
                self.process.kill()
                self.process.wait(10)
                log = self.log()
                self._log.close()
                raise RuntimeError(f"kernel did not start: {exc}\n{log}") from exc
            finally:
                marker.unlink(missing_ok=True)
        self.client = BlockingKernelClient(connection_file=str(self.connection_file))
        self.client.load_connection_file()
        # jupyter_client calls a kernel dead after one second without a heartbeat echo:
        # on a loaded test machine the client's own threads can be that late.
        self.client.hb_channel.time_to_dead = HEARTBEAT_GRACE
        self.client.start_channels()
        try:
            self.client.wait_for_ready(timeout=60)
        except RuntimeError as exc:
            if self.process.poll() is None:
                self.process.send_signal(signal.SIGUSR1)  # the wrapper logs its relay's state
                time.sleep(1)
            log = self.log()
            if self.process.poll() is None:
                log += "\n" + describe_threads(proctree.descendants(self.process.pid))
                self.process.kill()
            self.process.wait(10)
            self.close()
            raise RuntimeError(f"kernel did not start: {log}") from exc
        # wait_for_ready asks kernel_info again every second without a reply (and when IOPub
        # is quiet): on a loaded machine the extra replies arrive later and a test's next
        # get_shell_msg took one for its own reply. The kernel answers in order, so once one
        # more request is answered, nothing stale is left.
        last = self.client.kernel_info()
        while self.client.get_shell_msg(timeout=60)["parent_header"].get("msg_id") != last:
            pass
        self.control = WrapperClient(WrapperInfo.for_connection_file(self.connection_file).control)

    async def _restore(self, source: Path) -> None:
        async def alive() -> bool:
            return self.process.poll() is None

        wrapper = await WrapperClient.when_up(self.connection_file, alive)
        await wrapper.restore(RestoreRequest(source, lazy=self.lazily(source, Into.NEW_KERNEL)))

    def lazily(self, source: Path, into: Into = Into.IN_PLACE) -> bool:
        """Whether a restore of ``source`` (images on this machine) asked by this harness
        goes lazily: decided as the server decides for the restores it asks
        (core.lazypages.lazy_plan), with the settings the wrapper has."""
        try:
            manifest = Manifest.read(source)
        except SnapshotError:
            return False  # the wrapper says what is wrong with the snapshot
        plan = lazy_plan(
            self.lazy_settings, manifest, into=into, in_store=False, supported=_lazy_pages()
        )
        return plan.lazy

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")

    def execute(self, code: str, timeout: float = 120) -> str:
        """Run ``code``; return its stdout; raise with the traceback if it failed."""
        out: list[str] = []
        errors: list[str] = []

        def hook(msg: dict[str, Any]) -> None:
            if msg["msg_type"] == "stream":
                (out if msg["content"]["name"] == "stdout" else errors).append(
                    msg["content"]["text"]
                )
            elif msg["msg_type"] == "error":
                errors.append("\n".join(msg["content"]["traceback"]))

        reply = self.client.execute_interactive(code, timeout=timeout, output_hook=hook)
        if reply["content"]["status"] != "ok":
            raise AssertionError(f"cell failed: {''.join(errors)}\n{reply['content']}")
        return "".join(out)

    def status(self) -> dict[str, Any]:
        result: dict[str, Any] = self.control.request_sync("status", timeout=30)
        return result

    def snapshot(self, dest: Path, **args: Any) -> dict[str, Any]:
        result: dict[str, Any] = self.control.request_sync(
            "snapshot", {"dest": str(dest), **args}, timeout=300
        )
        return result

    def restore(self, source: Path, on_progress: ProgressCallback | None = None) -> dict[str, Any]:
        result: dict[str, Any] = self.control.request_sync(
            "restore",
            {"source": str(source), "lazy": self.lazily(source)},
            on_progress=on_progress,
            timeout=300,
        )
        return result

    def inner_pids(self) -> list[int]:
        pid = self.status()["inner_pid"]
        return proctree.descendants(pid) if pid else []

    def wait_exit(self, pids: list[int], timeout: float = 30) -> int:
        """Wait for the wrapper to exit; on a timeout, fail saying what every thread of the
        wrapper and of ``pids`` was doing (a Python stack too where py-spy is installed)."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"the kernel did not exit within {timeout} s:\n"
                + describe_threads([self.process.pid, *pids])
            ) from None

    def kill_inner(self) -> None:
        """kill -9 the inner kernel (the whole tree dies with its namespace's init)."""
        pid = self.status()["inner_pid"]
        os.kill(pid, signal.SIGKILL)
        wait_until(lambda: self.status()["state"] == "dead", what="inner kernel to die")

    def kill_all(self) -> None:
        """kill -9 the wrapper and every process of the kernel, as a node failure would: all
        stopped first, so that none sees another die (a resource tracker that saw its kernel
        go would unlink the kernel's /dev/shm segments: no node failure does that)."""
        pids = [self.process.pid, *proctree.descendants(self.process.pid)]
        for sig in (signal.SIGSTOP, signal.SIGKILL):
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        self.process.wait(10)
        wait_until(lambda: all(_gone(p) for p in pids), what="kernel to die")
        self.close()

    def shutdown(self) -> None:
        if self.process.poll() is None:
            try:
                self.client.shutdown()
                self.process.wait(15)
            except (subprocess.TimeoutExpired, RuntimeError):
                self.process.kill()
                self.process.wait(10)
        self.close()

    def end(self) -> None:
        """After a test: kill -9 what still runs, let go of the rest."""
        if self.process.poll() is None:
            self.kill_all()
        else:
            self.close()

    def close(self) -> None:
        """Let go of the client and the log (safe to call more than once)."""
        self.client.stop_channels()
        self._log.close()


def wait_until(condition: Callable[[], bool], timeout: float = 30, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.02)
    raise TimeoutError(f"timed out waiting for {what}")


def describe_threads(pids: list[int]) -> str:
    """Each thread's name, state and kernel wait channel; py-spy's dump if available."""
    lines = []
    for pid in pids:
        with contextlib.suppress(OSError):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            lines.append(f"{pid}: {cmdline.decode(errors='replace')[:200]}")
        for tid in sorted(os.listdir(f"/proc/{pid}/task")) if os.path.isdir(f"/proc/{pid}") else []:
            base = f"/proc/{pid}/task/{tid}"
            with contextlib.suppress(OSError):
                comm = Path(f"{base}/comm").read_text().strip()
                wchan = Path(f"{base}/wchan").read_text().strip()
                state = Path(f"{base}/stat").read_text().rsplit(")", 1)[1].split()[0]
                lines.append(f"{pid}/{tid} {comm} {state} {wchan}")
        spy = shutil.which("py-spy", path=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
        if spy and os.path.isdir(f"/proc/{pid}"):
            dump = subprocess.run([spy, "dump", "--pid", str(pid)], capture_output=True, text=True)
            lines.append(dump.stdout)
    return "\n".join(lines)


# -- servers: moto S3, jupyter server with the extension, its kernels' websockets --


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class MotoServer:
    """``moto_server -H 127.0.0.1 -p PORT``, started and waited for; ``stop()`` ends it."""

    def __init__(self, log_path: Path, timeout: float = 30.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = log_path.open("wb")
        moto_server = Path(sys.executable).with_name("moto_server")
        self.process = subprocess.Popen(
            [str(moto_server), "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + timeout
        while not self._answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"moto_server did not start: {log_path.read_text()}")
            time.sleep(0.1)

    def ensure_bucket(self, name: str) -> str:
        """Create the bucket ``name`` unless it exists; returns the name."""
        import boto3

        client = boto3.client("s3", endpoint_url=self.url)
        try:
            client.create_bucket(Bucket=name)
        except client.exceptions.BucketAlreadyOwnedByYou:
            pass
        finally:
            client.close()
        return name

    def enforce_credentials(self, user: str = "store-admin") -> tuple[str, str]:
        """Turn on moto's IAM enforcement: from now on only requests signed with a key of
        an IAM user (or role) whose policy allows them are served; others get 403
        (InvalidAccessKeyId, SignatureDoesNotMatch, AccessDenied). Returns the access key
        of ``user``, made first, with every S3 action on every resource. Make buckets before
        (``ensure_bucket``), or with this key after. moto checks header signatures and the
        users' policies; it does not evaluate STS session policies or presigned URLs, and
        accepts unsigned ``x-amz-*`` headers (AWS refuses them: "HeadersNotSigned")."""
        import json

        import boto3

        iam = boto3.client(
            "iam",
            endpoint_url=self.url,
            region_name="us-east-1",
            aws_access_key_id="before-enforcement",  # any key is accepted until then
            aws_secret_access_key="before-enforcement",
        )
        try:
            iam.create_user(UserName=user)
            policy = {
                "Version": "2012-10-17",
                "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}],
            }
            iam.put_user_policy(UserName=user, PolicyName="s3", PolicyDocument=json.dumps(policy))
            key = iam.create_access_key(UserName=user)["AccessKey"]
        finally:
            iam.close()
        request = urllib.request.Request(
            self.url + "/moto-api/reset-auth",
            data=b"0",  # requests served without credentials from now on
            method="POST",
            headers={"Content-Type": "text/plain"},
        )
        with urllib.request.urlopen(request, timeout=10):
            pass
        return key["AccessKeyId"], key["SecretAccessKey"]

    def _answers(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/moto-api/", timeout=1):
                return True
        except urllib.error.HTTPError:
            return True  # any HTTP answer means it is serving
        except OSError:
            return False

    def stop(self) -> None:
        end_process(self.process)
        self._log.close()


def end_process(process: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL after 10 s (a test server that did not stop)."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect (to a login page, say) is an answer to check, not one to follow."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_opener = urllib.request.build_opener(_NoRedirect)


class Endpoint:
    """A Jupyter server's REST API at a base URL with a token: a server of ours, or a
    user's server behind JupyterHub's proxy (``.../user/<name>/``). An empty token sends
    none."""

    def __init__(self, url: str, token: str) -> None:
        self.url = url.rstrip("/") + "/"
        self.token = token
        self.client = ServerClient(self.url, token)

    def api(self, method: str, path: str, body: Any = None) -> Any:
        """Any endpoint of the server (not only /api/snapshots); an error status raises
        ``urllib.error.HTTPError``, a redirect too."""
        request = urllib.request.Request(
            self.url + path,
            method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Authorization": f"token {self.token}"} if self.token else {},
        )
        try:
            with _opener.open(request, timeout=120) as response:
                data = response.read()
        except urllib.error.HTTPError as exc:
            exc.close()  # it holds the connection open until closed
            raise
        return json.loads(data) if data else None


def give_to(user: str, *paths: Path) -> None:
    """Make ``paths`` the ordinary ``user``'s (recursively), and let them through every
    directory above (pytest's own temporary directory is root's alone, mode 0700)."""
    for path in paths:
        subprocess.run(["chown", "-R", f"{user}:", str(path)], check=True)
        for parent in path.resolve().parents:
            mode = parent.stat().st_mode
            if not mode & 0o001:
                parent.chmod(mode | 0o001)


RUN_KEY = base64.b64encode(os.urandom(32)).decode()
"""The key-encryption key of every server of a run whose config names no key source:
servers on other homes (another node, a restart) share a user's store, as a spawner that
sets one user's key on every node ("env") would make them; a key file in each home would
not be the same key."""


def run_keys() -> EnvKeySource:
    """The key source that opens the stores of this run's servers (:data:`RUN_KEY`), for
    a test that reads a server's store directly."""
    return EnvKeySource({ENV_KEY: RUN_KEY})


# The server extensions a test server loads without ``lab``: ours alone (those installed
# beside it are turned off by name; one missing here is just not loaded).
OURS_ALONE = {
    "jpserver_extensions": {
        "jupyter_ext": True,
        "jupyterlab": False,
        "jupyter_lsp": False,
        "notebook_shim": False,
        "jupyter_server_terminals": False,
    }
}

# How a test server is started: as installed with ``lab``, else by testkit/quickserver.py.
SERVER_MAIN = {
    True: ["-m", "jupyter_server"],
    False: [str(Path(__file__).with_name("quickserver.py"))],
}


class ServerProcess(Endpoint):
    """``jupyter server`` with the snapshot extension, in its own data and runtime dirs."""

    def __init__(
        self,
        home: Path,
        root_dir: Path,
        config: dict[str, Any],
        *,
        netns: str | None = None,
        address: str = "127.0.0.1",
        env: dict[str, str] | None = None,
        user: str | None = None,
        pod: bool = False,
        umask: int | None = None,
        cgroup: Path | None = None,
        port: int | None = None,
        token: str | None = None,
        lab: bool = False,
    ) -> None:
        """``user``: run the server (and so its kernels and CRIU) as this ordinary user,
        from a root test run (non-root mode on other nodes, docs/nonroot.md). ``pod``: in
        a PID namespace of its own, with its own /proc, as in a container: process ids
        start at 1 and everything in it dies with its first process. ``cgroup``: in this
        cgroup (a memory limit, as a container's), with everything it starts. ``port``,
        ``token``: those of a server started again in its place (default: new ones).
        ``lab``: with the other server extensions installed here (JupyterLab's, for a
        browser); without, the server loads ours alone: JupyterLab's runs ``npm`` at each
        start, a second and a half of CPU that hundreds of server starts paid for nothing
        (no test here but a browser's uses its endpoints), and it starts from
        testkit.quickserver."""
        home.mkdir(parents=True, exist_ok=True)
        self.home = home
        self.port = port or free_port()
        self.address = address
        super().__init__(f"http://{address}:{self.port}/", token or uuid.uuid4().hex)
        app = config.get("SnapshotExtensionApp", {})
        if "encryption_key_source" not in app:
            config = {**config, "SnapshotExtensionApp": {**app, "encryption_key_source": "env"}}
            env = {ENV_KEY: RUN_KEY, **(env or {})}
        if "cell_checkpoints" not in app:
            # On in the product; off for tests that do not ask: a checkpoint after every
            # cell changes what they see of a kernel's dumps (and costs their time).
            config = {
                **config,
                "SnapshotExtensionApp": {
                    **config["SnapshotExtensionApp"],
                    "cell_checkpoints": "off",
                },
            }
        if not lab:
            config = {**config, "ServerApp": {**config.get("ServerApp", {}), **OURS_ALONE}}
        config_file = home / "config.json"
        config_file.write_text(json.dumps(config))
        self.env = {
            **os.environ,
            "JUPYTER_DATA_DIR": str(home / "data"),
            "JUPYTER_RUNTIME_DIR": str(home / "runtime"),
            "JUPYTER_CONFIG_DIR": str(home / "config"),
            "JUPYTER_SNAPSHOT_RUNTIME_DIR": str(home / "kernels"),
            **(env or {}),
        }
        argv = [
            sys.executable,
            *SERVER_MAIN[lab],
            "--allow-root",
            "--no-browser",
            f"--ServerApp.ip={address}",
            f"--ServerApp.port={self.port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={root_dir}",
            f"--config={config_file}",
        ]
        if user is not None:
            self.env.update(HOME=str(home), USER=user, LOGNAME=user, PYTHONDONTWRITEBYTECODE="1")
            give_to(user, home, root_dir)
            argv = ["runuser", "-u", user, "--", *argv]
        self.pod = pod
        if pod:
            argv = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child", *argv]
        if netns is not None:
            argv = ["ip", "netns", "exec", netns, *argv]
        if cgroup is not None:
            argv = ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(cgroup), *argv]
        self.log_path = home / "server.log"
        self._log = self.log_path.open("ab")  # a server started again here adds to it
        # Not our stdin: the server's children inherit it, and a Node.js one (JupyterLab
        # runs `npm prefix`) makes it non-blocking, which a helper reading commands from
        # the same stdin (tests/support/nodes_for_ui.py) took for its end, and stopped.
        self.process = subprocess.Popen(
            argv,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            umask=-1 if umask is None else umask,
        )
        self.wait_ready()

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited: {self.log()}")
            try:
                self.client.call("GET", "policy")
                return
            except Exception:  # noqa: BLE001 - not up yet
                time.sleep(0.2)
        raise TimeoutError(f"server did not start: {self.log()}")

    def _server_pid(self) -> int:
        """The Jupyter server's own process (below unshare and runuser)."""
        for pid in proctree.descendants(self.process.pid):  # parents first
            with contextlib.suppress(OSError):
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                if any(
                    argv[: len(main) + 1] == [sys.executable.encode(), *map(os.fsencode, main)]
                    for main in SERVER_MAIN.values()
                ):
                    return pid
        return self.process.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def kernel_processes(self) -> list[int]:
        """The server's process group: the server, its kernels' wrappers and inner kernels."""
        out = subprocess.run(
            ["ps", "-e", "-o", "pid=,sid="], capture_output=True, text=True, check=True
        ).stdout
        session = os.getsid(self.process.pid)
        pids = [int(p) for p, s in (line.split() for line in out.splitlines()) if int(s) == session]
        return pids

    def kill_node(self) -> None:
        """kill -9 the server and every process it started, as a node failure would."""
        pids = set(self.kernel_processes())
        for pid in list(pids):
            pids.update(proctree.descendants(pid))
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait(10)
        self._log.close()

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 120) -> int:
        if self.process.poll() is None:
            if self.pod:  # unshare ignores the signal (its child, the pod, would have to end)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self._server_pid(), sig)
            else:
                self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill_node()
        self._log.close()
        return self.process.returncode


def kernel_message(
    msg_type: str, content: dict[str, Any], metadata: dict[str, Any] | None = None
) -> tuple[str, str]:
    """A request for a kernel's websocket, as JupyterLab sends it: (its msg_id, its JSON)."""
    msg_id = uuid.uuid4().hex
    header = {
        "msg_id": msg_id,
        "msg_type": msg_type,
        "session": uuid.uuid4().hex,
        "username": "test",
        "date": "2026-01-01T00:00:00Z",
        "version": "5.3",
    }
    message = {
        "header": header,
        "parent_header": {},
        "metadata": metadata or {},
        "content": content,
        "channel": "shell",
        "buffers": [],
    }
    return msg_id, json.dumps(message)


def execute_request(code: str, cell_id: str | None = None) -> tuple[str, str]:
    """An execute_request (from the cell ``cell_id``, as JupyterLab names it)."""
    content = {
        "code": code,
        "silent": False,
        "store_history": True,
        "user_expressions": {},
        "allow_stdin": False,
    }
    return kernel_message("execute_request", content, {"cellId": cell_id} if cell_id else None)


async def ws_connect(server: Endpoint, kernel_id: str) -> WebSocketClientConnection:
    """A websocket to a kernel's channels, as JupyterLab opens it."""
    from tornado.httpclient import HTTPRequest
    from tornado.websocket import websocket_connect

    url = "ws" + server.url.removeprefix("http") + f"api/kernels/{kernel_id}/channels"
    # jupyter_server answers the handshake once the kernel answered kernel_info, or after
    # its kernel_info_timeout (60 s) without it; tornado's own default (20 s) would give
    # up first, and hide what the server says then.
    request = HTTPRequest(
        url,
        headers={"Authorization": f"token {server.token}"},
        connect_timeout=90,
        request_timeout=90,
    )
    return await websocket_connect(request)


async def ws_close(ws: WebSocketClientConnection) -> None:
    """Close, and wait until the socket is shut: the loop must not end with it open (it
    would be left to the garbage collector); after 1 s it is dropped."""
    import asyncio

    # close() forgets the protocol; its stream says when the socket is shut.
    stream = ws.protocol.stream if ws.protocol is not None else None
    ws.close()
    for _ in range(100):
        if stream is None or stream.closed():
            break
        await asyncio.sleep(0.01)
    if stream is not None and not stream.closed():
        stream.close()
