"""The server's kernels as the manager sees them: looked up by id, their wrappers, new
ones started to restore into, and the one guard every request that dumps goes
through."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core import private
from ..core.errors import (
    KernelNotFoundError,
    KernelNotRunningError,
    SnapshotError,
    WrapperUnavailableError,
)
from ..core.leftovers import DumpLock, after_failed_dump
from ..core.manifest import Manifest
from ..core.protocol.control import (
    EXIT_PORT_IN_USE,
    PORT_ATTEMPTS,
    KernelStatus,
    Restored,
    RestoreRequest,
    StatusArgs,
    WrapperClient,
    WrapperInfo,
)
from ..core.protocol.environment import ENV_AWAIT_RESTORE
from ..core.protocol.progress import ProgressCallback
from .reaping import Reaper
from .shared import check_kernel_id

logger = logging.getLogger(__name__)


@dataclass
class Dumped:
    """What a wrapper request that dumps the kernel into a folder left (see
    :meth:`Kernels.request_dumping_into`)."""

    answer: Any = None
    """The wrapper's answer, when the request succeeded."""
    sealed: Manifest | None = None
    """Else the snapshot the wrapper sealed there before it died (the kernel's state)."""
    error: SnapshotError | None = None
    """Why the request failed, when ``sealed`` is set."""

    @property
    def manifest(self) -> Manifest:
        """The snapshot dumped: sealed, or as a snapshot or suspend request answered."""
        return self.sealed if self.sealed is not None else Manifest.from_dict(self.answer)


@dataclass(frozen=True)
class KernelHandle:
    """A kernel as a job resolved it, once, when it started: the server's manager of it
    and its wrapper (its info file read once), carried through the job."""

    id: str
    manager: Any
    """jupyter_client's manager of the kernel (the server's ``get_kernel``)."""
    info: WrapperInfo
    """The wrapper's info file as read when the job resolved the kernel."""

    @property
    def name(self) -> str:
        """The kernelspec's name."""
        return str(self.manager.kernel_name)

    @property
    def wrapper(self) -> WrapperClient:
        return WrapperClient(self.info.control)


class Kernels:
    """The server's kernels (its kernel manager) and their wrappers."""

    def __init__(self, kernel_manager: Any, reaper: Reaper, work_dir: Path) -> None:
        self.kernel_manager = kernel_manager
        self.reaper = reaper
        self.work_dir = work_dir

    def ids(self) -> list[str]:
        return list(self.kernel_manager.list_kernel_ids())

    def kernel(self, kernel_id: str) -> Any:
        """The server's kernel ``kernel_id``; KernelNotFoundError if there is none."""
        check_kernel_id(kernel_id)
        if kernel_id not in self.kernel_manager:
            raise KernelNotFoundError(f"There is no kernel {kernel_id} on this server.")
        return self.kernel_manager.get_kernel(kernel_id)

    def handle(self, kernel_id: str) -> KernelHandle:
        """The kernel and its wrapper, looked up once for a job (its inner kernel is
        reaped once orphaned); KernelNotFoundError, WrapperUnavailableError."""
        km = self.kernel(kernel_id)
        info = WrapperInfo.for_connection_file(Path(km.connection_file))
        if info.inner_pid:
            self.reaper.watch(info.inner_pid)
        return KernelHandle(kernel_id, km, info)

    def wrapper(self, kernel_id: str) -> WrapperClient:
        """A client of the kernel's wrapper, for one request."""
        return self.handle(kernel_id).wrapper

    async def status(self, kernel_id: str, *, gpu: bool = False) -> KernelStatus | None:
        """The kernel's status as its wrapper answers it (with its GPU accounting if
        ``gpu``); None if it is not a snapshot kernel, or went away since it was listed."""
        try:
            return await self.wrapper(kernel_id).status(StatusArgs(gpu=gpu))
        except (WrapperUnavailableError, KernelNotFoundError):
            return None

    async def alive(self, kernel_id: str) -> bool:
        """Whether the kernel is still this server's and its process runs."""
        if kernel_id not in self.kernel_manager:
            return False
        try:
            return bool(await self.kernel(kernel_id).is_alive())
        except SnapshotError:
            return False

    async def request_dumping_into(
        self,
        kernel: KernelHandle,
        dest: Path,
        request: Callable[[WrapperClient], Awaitable[Any]],
        *,
        catch: type[SnapshotError] = SnapshotError,
        keep_error: bool = False,
    ) -> Dumped:
        """Run ``request`` on the kernel's wrapper, which dumps the kernel into ``dest``,
        under a :class:`DumpLock` (if this server dies meanwhile, its next start cleans
        up). If it fails with ``catch``, :func:`after_failed_dump` decides: what the
        wrapper sealed before it died is kept and returned, with the error; anything else
        is removed and the error raised (with ``keep_error`` the request's own, else as
        after_failed_dump puts it, plainer for a full disk)."""
        lock = DumpLock(dest)
        try:
            return Dumped(answer=await request(kernel.wrapper))
        except catch as exc:
            try:
                sealed = await asyncio.to_thread(after_failed_dump, exc, dest, kernel.info.pid)
            except SnapshotError:
                if keep_error:
                    raise exc from None
                raise
            return Dumped(sealed=sealed, error=exc)
        finally:
            lock.release()

    async def start_restored(
        self,
        kernel_name: str,
        notebook_path: str | None,
        request: RestoreRequest,
        progress: ProgressCallback,
    ) -> tuple[str, Restored]:
        """Start a new kernel whose wrapper waits for a restore, and restore ``request``
        into it over its control socket, like any other operation: its id and the
        wrapper's reply."""
        self.reaper.start()
        notebook_dir = str(Path(notebook_path).parent) if notebook_path else None
        attempt = 1
        while True:
            marker = self.work_dir / f"await-restore-{secrets.token_hex(8)}"
            private.write_file(marker, b"")
            env = {**os.environ, ENV_AWAIT_RESTORE: str(marker)}
            try:
                kernel_id: str = await self.kernel_manager.start_kernel(
                    kernel_name=kernel_name, path=notebook_dir, env=env
                )
                km = self.kernel(kernel_id)
                try:
                    wrapper = await WrapperClient.when_up(Path(km.connection_file), km.is_alive)
                    restored = await wrapper.restore(request, progress)
                except BaseException as exc:
                    exited = isinstance(exc, KernelNotRunningError) and km.provisioner
                    status = await km.provisioner.poll() if exited else None
                    with contextlib.suppress(Exception):
                        await self.kernel_manager.shutdown_kernel(kernel_id, now=True)
                    if status == EXIT_PORT_IN_USE and attempt < PORT_ATTEMPTS:
                        # A port jupyter_client picked was taken before the wrapper bound
                        # it: start another kernel, on new ports (its restarter would).
                        logger.info("a port of the kernel to restore into was taken: again")
                        attempt += 1
                        continue
                    raise
            finally:
                marker.unlink(missing_ok=True)  # the wrapper took it, unless it never came up
            self.wrapper(kernel_id)  # the server reaps the restored kernel once orphaned
            return kernel_id, restored
