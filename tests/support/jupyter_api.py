"""Helpers for tests against an in-process jupyter_server (pytest-jupyter)."""

from __future__ import annotations

import asyncio
import functools
import json
import re
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from jupyter_client.asynchronous import AsyncKernelClient
from tornado.httpclient import HTTPClientError

from jupyter_ext.core.protocol.control import EXIT_PORT_IN_USE, PORT_ATTEMPTS
from jupyter_ext.core.store import LocalStore
from jupyter_ext.kernelspecs import install_kernelspec
from jupyter_ext.manager import SnapshotManager

Fetch = Callable[..., Awaitable[Any]]


@pytest.fixture
def snapshot_kernelspec(jp_environ: None) -> str:
    """The server's kernels come from an isolated data dir: install ours there."""
    return install_kernelspec(user=True)


def events_of(jp_serverapp: Any) -> list[dict[str, Any]]:
    """The snapshot events the server emits from now on, as they come."""
    from jupyter_ext.app import EVENT_SCHEMA_ID

    seen: list[dict[str, Any]] = []

    async def listener(logger: Any, schema_id: str, data: dict[str, Any]) -> None:
        seen.append(data)

    jp_serverapp.event_logger.add_listener(schema_id=EVENT_SCHEMA_ID, listener=listener)
    return seen


def manager_of(jp_serverapp: Any) -> SnapshotManager:
    manager: SnapshotManager = jp_serverapp.extension_manager.extension_points[
        "jupyter_ext"
    ].app.manager
    return manager


def middle_chunk(manager: SnapshotManager, snapshot_id: str, prefix: str) -> tuple[str, Any]:
    """The middle chunk of a snapshot's largest stored file whose path starts with
    ``prefix``: that path and the chunk's reference (its hash, where it is stored). For
    ``images/pages-``, memory of the kernel's largest array, which a restored kernel does
    not read until a cell uses it. (Image names hold process ids, which differ without
    root: ``core-1.img`` in a PID namespace.)"""
    record = manager.store.index.load(snapshot_id)
    assert record is not None
    # The memory of a snapshot copied while the kernel ran is in the levels of its chain
    # (images/parent/...: core/criu/chain.py), named as the top level's.
    levels = re.compile(re.escape(prefix).replace("images/", r"images/(?:parent/)*", 1))
    path = max(
        (p for p in record.chunks if levels.match(p)),
        key=lambda p: sum(ref.size for ref in record.chunks[p]),
    )
    refs = record.chunks[path]
    return path, refs[len(refs) // 2]


def damage_chunk(manager: SnapshotManager, snapshot_id: str, prefix: str) -> str:
    """Flip a byte of the :func:`middle_chunk` (local store); returns its file's path."""
    store = manager.store
    assert isinstance(store, LocalStore)
    path, ref = middle_chunk(manager, snapshot_id, prefix)
    where = ref.where
    pack = store.root / where.obj
    mode = pack.stat().st_mode
    pack.chmod(mode | 0o200)  # packs are read-only; root would not notice
    data = bytearray(pack.read_bytes())
    data[where.offset + where.length // 2] ^= 0xFF
    pack.write_bytes(bytes(data))
    pack.chmod(mode)
    return path


def server_config(tmp_path: Path, **extension: Any) -> dict[str, Any]:
    """jupyter_server config with the extension on a local store in ``tmp_path``."""
    return {
        "ServerApp": {
            "jpserver_extensions": {"jupyter_ext": True},
            "allow_unauthenticated_access": False,
        },
        "SnapshotExtensionApp": {
            "local_store_dir": str(tmp_path / "store"),
            "work_dir": str(tmp_path / "work"),
            "idle_suspend_after": 0,
            "snapshot_before_shutdown": False,
            "keep_last": 0,
            # On by default; off here, so that no test gets a snapshot it did not ask for
            # (tests/test_policies.py turns it on with a small threshold).
            "long_cell_seconds": 0,
            "policy_tick": 0.2,
            # Restores read the store (what most tests check): tests/test_image_cache.py
            # turns the local image cache on.
            "image_cache_max_bytes": 0,
            # On by default; off here: a checkpoint after every cell would change what the
            # other tests see of a kernel's dumps (tests/test_cell_checkpoints.py has them).
            "cell_checkpoints": "off",
            **extension,
        },
    }


async def call(jp_fetch: Fetch, method: str, *path: str, body: Any = None, **params: str) -> Any:
    kwargs: dict[str, Any] = {"method": method, "params": params}
    if body is not None:
        kwargs["body"] = json.dumps(body)
    elif method in ("POST", "PATCH"):
        kwargs["body"] = "{}"
    response = await jp_fetch("api", "snapshots", *path, **kwargs)
    return json.loads(response.body) if response.body else None


async def error_of(jp_fetch: Fetch, method: str, *path: str, body: Any = None) -> tuple[int, dict]:
    with pytest.raises(HTTPClientError) as info:
        await call(jp_fetch, method, *path, body=body)
    assert info.value.response is not None
    return info.value.code, json.loads(info.value.response.body)


async def wait_job(jp_fetch: Fetch, job: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
    for _ in range(int(timeout * 20)):
        job = await call(jp_fetch, "GET", "jobs", job["id"])
        if job["status"] != "running":
            return job
        await asyncio.sleep(0.05)
    raise TimeoutError(job)


class Kernel:
    def __init__(self, kernel_id: str, client: AsyncKernelClient) -> None:
        self.id = kernel_id
        self.client = client

    async def run(self, code: str) -> str:
        out: list[str] = []

        def hook(msg: dict[str, Any]) -> None:
            if msg["msg_type"] == "stream":
                out.append(msg["content"]["text"])

        reply = await self.client.execute_interactive(code, timeout=60, output_hook=hook)
        assert reply["content"]["status"] == "ok", reply["content"]
        return "".join(out)


@pytest.fixture
def start_kernel(jp_fetch: Fetch, jp_serverapp: Any, jp_asyncio_loop: Any) -> Any:
    clients: list[AsyncKernelClient] = []

    async def start(kernel_id: str | None = None) -> Kernel:
        if kernel_id is None:
            response = await jp_fetch(
                "api", "kernels", method="POST", body=json.dumps({"name": "python3-snapshot"})
            )
            kernel_id = json.loads(response.body)["id"]
        km = jp_serverapp.kernel_manager.get_kernel(kernel_id)
        for attempt in range(PORT_ATTEMPTS):
            process = km.provisioner.process
            # With the kernel manager as parent, wait_for_ready asks it whether the kernel
            # process lives; without, jupyter_client judges that by heartbeats and calls the
            # kernel dead after one echo later than a second (on a loaded machine:
            # "RuntimeError: Kernel died before replying to kernel_info"). Not km.client():
            # that shares the manager's session, whose id is the shell socket's identity,
            # and another client of it (variables.execute) would take this one's routing.
            client = AsyncKernelClient(connection_file=km.connection_file, parent=km)
            client.load_connection_file()
            client.start_channels()
            try:
                await client.wait_for_ready(timeout=60)
                break
            except RuntimeError as exc:
                client.stop_channels()
                status = process.poll()
                if status != EXIT_PORT_IN_USE or attempt == PORT_ATTEMPTS - 1:
                    raise RuntimeError(
                        f"{exc} (the kernel wrapper's exit status: {status})"
                    ) from exc
            # A port jupyter_client picked was taken before the wrapper bound it (another
            # test's kernel connected from it): the server's restarter starts the kernel
            # again on new ports, and a frontend connects to them, as here.
            await until(functools.partial(_started_again, km, process))
        clients.append(client)
        return Kernel(kernel_id, client)

    yield start
    for client in clients:
        client.stop_channels()
    shut_down_kernels(jp_serverapp, jp_asyncio_loop)


def shut_down_kernels(app: Any, loop: Any) -> None:
    """Shut the server's kernels down and reap their processes. jupyter_client stops
    waiting for a killed kernel after 5 s and drops its process unreaped (a wrapper whose
    thread is syncing a snapshot's images to a busy disk dies later), and a restart its
    restarter began (the test killed a wrapper) launches a new process after a shutdown
    that came meanwhile: the process's ``ResourceWarning`` then came out in whichever test
    ran when it was collected (once: inside the AST that Hypothesis was building, a
    CPython ``SystemError`` besides). So no restart begins from now, one under way ends
    first, and every process seen is reaped (killed if it still runs)."""
    manager = getattr(app, "kernel_manager", None)
    if manager is None:
        return
    kernels = [manager.get_kernel(kernel_id) for kernel_id in manager.list_kernel_ids()]
    for km in kernels:
        km.stop_restarter()
    loop.run_until_complete(_restarts_ended(kernels))
    processes = _processes(kernels)
    loop.run_until_complete(manager.shutdown_all(now=True))
    for process in processes | _processes(kernels):
        if process.poll() is None:
            process.kill()
        process.wait(60)


def _processes(kernels: list[Any]) -> set[Any]:
    return {
        km.provisioner.process
        for km in kernels
        if km.provisioner is not None and km.provisioner.process is not None
    }


async def _restarts_ended(kernels: list[Any], timeout: float = 60) -> None:
    """Until no kernel is starting, restarting or shutting down (``ready`` is pending
    meanwhile, and a restart's start follows its shutdown without a gap)."""
    deadline = time.monotonic() + timeout
    while any(not km.ready.done() for km in kernels) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


async def _started_again(km: Any, dead: Any) -> bool:
    """Whether the server started the kernel again (a new process, still running)."""
    process = km.provisioner.process if km.provisioner is not None else None
    return process is not None and process is not dead and process.poll() is None


@pytest.fixture
def running_extensions(jp_serverapp: Any, jp_asyncio_loop: Any) -> None:
    """What a real server does once its loop runs (pytest-jupyter skips it): start the
    extensions' background work, here the snapshot policies."""
    jp_asyncio_loop.run_until_complete(jp_serverapp.extension_manager.start_all_extensions())


async def until(condition: Callable[[], Awaitable[bool]], timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not await condition():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met")
        await asyncio.sleep(0.1)


async def snapshot(jp_fetch: Fetch, kernel_id: str) -> dict[str, Any]:
    """Create a snapshot and wait for its job."""
    return await wait_job(
        jp_fetch, (await call(jp_fetch, "POST", body={"kernel_id": kernel_id}))["job"]
    )


async def restore(jp_fetch: Fetch, snapshot_id: str, **body: str) -> dict[str, Any]:
    answer = await call(jp_fetch, "POST", snapshot_id, "restore", body=body)
    return await wait_job(jp_fetch, answer["job"])
