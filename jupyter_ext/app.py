"""The server extension: snapshot manager, REST API, events and policies."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from jupyter_server.serverapp import ServerApp

from . import memory
from .autosnap import PolicyTick
from .core import private
from .core.checkpoints import CheckpointSettings
from .core.errors import SnapshotError
from .core.policies.tick import PolicySettings
from .core.private import GROUP_SHARED, PRIVATE
from .core.protocol.environment import (
    ENV_CELL_CHECKPOINTS,
    ENV_KEY,
    ENV_PID_FLOOR,
    ENV_PREVIOUS_KEYS,
)
from .core.store import SnapshotStore, open_store
from .culling import CullingPolicy
from .handlers import route_table
from .manager import ManagerSettings, SnapshotManager
from .settings import SnapshotSettings

EVENT_SCHEMA = Path(__file__).parent / "events" / "snapshot.yaml"
_frozen = False


def _freeze_start_up_objects() -> None:
    """What the server loaded to start lives as long as it does: kept out of the cycle
    collector's full passes (``gc.freeze``), which then cost 5-8 ms instead of 70-100 ms
    (measured here), a pause that used to land in nearly every snapshot job. Once per
    process (tests start many servers in one)."""
    global _frozen
    if not _frozen:
        _frozen = True
        gc.collect()
        gc.freeze()


EVENT_SCHEMA_ID = "https://events.jupyter.org/jupyter_kernel_snapshots/snapshot/v1"


class SnapshotExtensionApp(SnapshotSettings):
    """Snapshots of whole kernel processes, periodically and on demand. Its options are
    :class:`SnapshotSettings`' traits, configured under this class's name."""

    name = "jupyter_ext"
    description = __doc__

    def make_store(self) -> SnapshotStore:
        """The owner's store (:meth:`store_spec`). An "env" key is taken out of this
        process's environment once read, so kernels (started with it) do not inherit it."""
        spec = self.store_spec()
        store = open_store(spec)
        if self.encryption_key_source == "env":
            for name in (ENV_KEY, ENV_PREVIOUS_KEYS):
                os.environ.pop(name, None)
        if self.encryption_key_source == "none":
            self.log.warning(
                "kernel snapshots: the store is NOT encrypted (encryption_key_source 'none'): "
                "whoever may read %s reads every snapshot, the kernels' whole memory.",
                spec.location(),
            )
        return store

    def policy(self) -> dict[str, Any]:
        """The server-side policy, shown read-only in the panel."""
        return {
            "store": self.store,
            "location": (
                f"s3://{self.s3_bucket}/{self.s3_prefix}"
                if self.store == "s3"
                else self.local_store_dir
            ),
            "encryption": self.encryption_key_source != "none",
            "periodic_interval": self.periodic_interval,
            "keep_last": self.keep_last,
            "keep_hourly_hours": self.keep_hourly_hours,
            "keep_daily_days": self.keep_daily_days,
            "long_cell_seconds": self.long_cell_seconds,
            "long_cell_min_interval": self.long_cell_min_interval,
            "max_store_bytes": self.max_store_bytes,
            "snapshot_before_shutdown": self.snapshot_before_shutdown,
            "idle_suspend_after": self.idle_suspend_after,
            "suspend_cpu_kernels": self.suspend_cpu_kernels,
            "cull_action": self.cull_action,
            "admin_shutdown_action": self.admin_shutdown_action,
            "cull_idle_timeout": self.server.kernel_manager.cull_idle_timeout,
            "restore_on_death": self.restore_on_death,
            "cell_checkpoints": self.cell_checkpoints,
            "cell_checkpoints_keep": self.cell_checkpoints_keep,
            "cell_checkpoints_max_bytes": self.cell_checkpoints_max_bytes,
            "cell_checkpoint_max_change_bytes": self.cell_checkpoint_max_change_bytes,
            "cell_checkpoint_max_pause_share": self.cell_checkpoint_max_pause_share,
        }

    def checkpoint_settings(self) -> CheckpointSettings:
        """What the kernel wrappers this server starts take their cell checkpoints with."""
        return CheckpointSettings(
            mode=self.cell_checkpoints,
            root=str(self.manager.workspace.checkpoints_dir),
            keep=self.cell_checkpoints_keep,
            max_bytes=self.cell_checkpoints_max_bytes,
            max_change_bytes=self.cell_checkpoint_max_change_bytes,
            max_pause_share=self.cell_checkpoint_max_pause_share,
            track_memory=self.track_memory,
            chunk_kib=self.chunk_kib or None,
        )

    @property
    def server(self) -> ServerApp:
        assert self.serverapp is not None, "the extension is not linked to a server"
        return self.serverapp

    def initialize_settings(self) -> None:
        assert self.server.event_logger is not None
        self.server.event_logger.register_event_schema(EVENT_SCHEMA)
        self.manager = SnapshotManager(
            kernel_manager=self.server.kernel_manager,
            session_manager=self.server.session_manager,
            store=self.make_store(),
            work_dir=Path(self.work_dir),
            emit=self.emit,
            settings=ManagerSettings.from_traits(self),
        )
        self.manager.deaths.install()
        self.manager.paths.install(self.server.contents_manager)
        self._tighten()
        self.culling = CullingPolicy(
            self.server,
            self.manager,
            cull_action=self.cull_action,
            admin_shutdown_action=self.admin_shutdown_action,
            owner=self.owner,
        )
        self.culling.install()
        self._pass_settings_to_wrappers()
        self.policies = PolicyTick(
            self.manager,
            PolicySettings(
                periodic_interval=self.periodic_interval,
                long_cell_seconds=self.long_cell_seconds,
                long_cell_min_interval=self.long_cell_min_interval,
                idle_suspend_after=self.idle_suspend_after,
                suspend_cpu_kernels=self.suspend_cpu_kernels,
            ),
        )
        self._policy_task: asyncio.Task[None] | None = None
        self._stopping: asyncio.Future[None] | None = None
        self._recovery: asyncio.Future[None] | None = None

    def _pass_settings_to_wrappers(self) -> None:
        """What a kernel wrapper reads of these settings reaches it in the environment of
        each snapshot kernel the server starts (the kernel manager's ``start_kernel``
        wrapped on the instance), never through the server's own environment."""
        km: Any = self.server.kernel_manager
        start: Callable[..., Awaitable[str]] = km.start_kernel
        settings = {
            **self.manager.settings.lazy.to_env(),
            ENV_PID_FLOOR: str(self.kernel_pid_floor),
            ENV_CELL_CHECKPOINTS: self.checkpoint_settings().to_json(),
        }

        async def start_kernel(*args: Any, **kwargs: Any) -> str:
            name = kwargs.get("kernel_name") or km.default_kernel_name
            try:
                metadata = km.kernel_spec_manager.get_kernel_spec(name).metadata or {}
            except Exception:  # noqa: BLE001 - jupyter_client says what is missing itself
                metadata = {}
            if "kernel_snapshots" in metadata:
                kwargs["env"] = {**(kwargs.get("env") or os.environ), **settings}
            return await start(*args, **kwargs)

        km.start_kernel = start_kernel

    def _tighten(self) -> None:
        """Owner-only again what an older version (or another umask) left readable by
        others in the store and the work directory; said in the log."""
        try:
            changed = self.manager.tighten()
            if self.store == "local":  # the directories above the user's: they list users
                modes = GROUP_SHARED if self.local_store_group_access else PRIVATE
                top = Path(self.local_store_dir)
                for directory in (top, top / "users"):
                    changed += private.tighten(directory, modes, recursive=False)
        except SnapshotError as exc:
            self.log.error("kernel snapshots: %s %s", exc.message, exc.hint)
            return
        if changed:
            shown = ", ".join(found.describe() for found in changed[:10])
            more = f" and {len(changed) - 10} more" if len(changed) > 10 else ""
            self.log.warning(
                "kernel snapshots: %d path(s) other users could read are now owner-only: %s%s",
                len(changed),
                shown,
                more,
            )

    def initialize_handlers(self) -> None:
        self.handlers.extend(route_table(self.manager, self.policy()))

    def emit(self, action: str, data: dict[str, Any]) -> None:
        payload = {"action": action, **{k: v for k, v in data.items() if v is not None}}
        logger = self.server.event_logger
        with contextlib.suppress(Exception):  # an event must never break the work itself
            if logger is not None:
                logger.emit(schema_id=EVENT_SCHEMA_ID, data=payload)

    async def _policy_loop(self) -> None:
        """The snapshot policies (autosnap.PolicyTick) and upload retries, one tick at a time."""
        last_retry = asyncio.get_running_loop().time()
        while True:
            await asyncio.sleep(self.policy_tick)
            now = asyncio.get_running_loop().time()
            try:
                await self.policies.tick()
                await self.manager.checkpoints.sweep()  # those of kernels that are gone
                if now - last_retry >= self.upload_retry_interval:
                    last_retry = now
                    await self.manager.uploads.retry()
            except Exception:
                self.log.exception("snapshot policy tick failed")

    async def _start_jupyter_server_extension(self, serverapp: Any) -> None:
        """Called by jupyter_server once its event loop runs: start the policies, and the
        uploads of snapshots a previous run of this server could not store."""
        self.manager.reaper.start()  # without root: see Reaper.start
        await self.manager.checkpoints.sweep()
        _freeze_start_up_objects()
        memory.tune()
        recovered = self.manager.uploads.recover_staged()
        if recovered:
            self.log.info("uploading %d snapshot(s) kept locally: %s", len(recovered), recovered)
            self._recovery = asyncio.ensure_future(self.manager.uploads.retry())
        self._policy_task = asyncio.ensure_future(self._policy_loop())
        self.manager.jobs.spawn(self._say_key_notice())
        if os.environ.get("JUPYTERHUB_API_TOKEN") and (
            signal.getsignal(signal.SIGINT) is signal.default_int_handler
        ):
            # JupyterHub's local spawners (and so its idle culler) stop a server with
            # SIGINT. jupyter_server handles SIGINT only on a terminal; without one it
            # would end at once: no snapshots before shutdown, kernels left running.
            signal.signal(signal.SIGINT, self._stop_on_sigint)

    async def _say_key_notice(self) -> None:
        """Say at start, once, if the store's key would be lost with this machine (the
        panel and doctor say it too, until the user keeps a copy)."""
        notice = await self.manager.snapshots.read_key_notice()
        if notice:
            self.log.warning("kernel snapshots: %s", notice)

    def _stop_on_sigint(self, signum: int, frame: object) -> None:
        self.log.info("SIGINT: stopping the server (its kernels are snapshotted first)")
        self.server.stop(from_signal=True)

    async def stop_extension(self) -> None:
        """Snapshot the kernels (if configured), then let go of the store. A second stop
        (a SIGTERM after a hub's SIGINT) waits for the same work instead of cutting it."""
        if self._stopping is None:
            self._stopping = asyncio.ensure_future(self._stop())
        await asyncio.shield(self._stopping)

    async def _stop(self) -> None:
        if self._policy_task is not None:
            self._policy_task.cancel()
        if self.snapshot_before_shutdown:
            jobs = await self.manager.schedules.snapshot_all(
                "before-shutdown", self.shutdown_snapshot_timeout
            )
            if jobs:
                self.log.info("snapshots before shutdown: %s", [j.status for j in jobs])
        self.manager.store.close()
        self.manager.reaper.stop()
