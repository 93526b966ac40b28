"""REST API under /api/snapshots (see openapi.yaml beside this module).

Every verb is authenticated and authorized on the ``kernels`` resource; ids in URLs are
validated by the route patterns and again by the manager; domain errors become HTTP
errors with the cause and what to do, in one place (:meth:`SnapshotHandler.write_error`).
"""

from __future__ import annotations

import json
from typing import Any

from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from tornado import web

from .core.errors import (
    CriuNotFoundError,
    DumpError,
    IncompatibleSnapshotError,
    KernelNotRunningError,
    RestoreError,
    SnapshotBusyError,
    SnapshotCorruptError,
    SnapshotError,
    SnapshotNotFoundError,
    WrapperUnavailableError,
)
from .core.store import StoreError
from .manager import SnapshotManager, validate_notebook_path

HTTP_STATUS: dict[type[SnapshotError], int] = {
    SnapshotNotFoundError: 404,
    SnapshotBusyError: 409,
    KernelNotRunningError: 409,
    WrapperUnavailableError: 409,
    DumpError: 409,
    SnapshotCorruptError: 422,
    IncompatibleSnapshotError: 422,
    CriuNotFoundError: 503,
    RestoreError: 500,
    StoreError: 503,
}
SNAPSHOT_ID = r"(?P<snapshot_id>[^/]+)"
KERNEL_ID = r"(?P<kernel_id>[^/]+)"
JOB_ID = r"(?P<job_id>[^/]+)"
TRIGGERS = ("manual", "periodic", "idle-suspend", "before-shutdown")


class SnapshotHandler(APIHandler):
    """Base: the manager comes in through initialize(); errors are turned into HTTP here."""

    auth_resource = "kernels"

    def initialize(self, manager: SnapshotManager, policy: dict[str, Any]) -> None:
        self.manager = manager
        self.policy = policy

    def body(self) -> dict[str, Any]:
        if not self.request.body:
            return {}
        try:
            data = json.loads(self.request.body)
        except ValueError as exc:
            raise web.HTTPError(400, f"The request body is not JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise web.HTTPError(400, "The request body must be a JSON object.")
        return data

    def reply(self, data: Any, status: int = 200) -> None:
        self.set_status(status)
        self.finish(json.dumps(data))

    def _handle_request_exception(self, e: BaseException) -> None:
        if isinstance(e, SnapshotError):
            status = next((s for cls, s in HTTP_STATUS.items() if isinstance(e, cls)), 500)
            self.set_status(status)
            self.finish(json.dumps({"message": e.message, "reason": e.code, **e.to_dict()}))
            return
        if isinstance(e, ValueError):
            self.set_status(400)
            self.finish(json.dumps({"message": str(e), "reason": "bad-request"}))
            return
        super()._handle_request_exception(e)


class SnapshotsHandler(SnapshotHandler):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        path = self.get_query_argument("path", None)
        trigger = self.get_query_argument("trigger", None)
        if trigger is not None and trigger not in TRIGGERS:
            raise ValueError(f"trigger must be one of {', '.join(TRIGGERS)}.")
        listing = await self.manager.list_snapshots(
            kernel_id=self.get_query_argument("kernel_id", None),
            path=validate_notebook_path(path) if path else None,
            trigger=trigger,
        )
        self.reply(listing)

    @web.authenticated
    @authorized
    async def post(self) -> None:
        body = self.body()
        kernel_id = body.get("kernel_id")
        if not isinstance(kernel_id, str):
            raise ValueError("kernel_id (a string) is required.")
        job = self.manager.create(kernel_id, trigger="manual")
        self.reply({"job": job.to_dict()}, status=202)


class SnapshotItemHandler(SnapshotHandler):
    @web.authenticated
    @authorized
    async def get(self, snapshot_id: str) -> None:
        self.reply(await self.manager.get(snapshot_id))

    @web.authenticated
    @authorized
    async def delete(self, snapshot_id: str) -> None:
        await self.manager.delete(snapshot_id)
        self.set_status(204)
        self.finish()


class RestoreHandler(SnapshotHandler):
    @web.authenticated
    @authorized
    async def post(self, snapshot_id: str) -> None:
        body = self.body()
        kernel_id = body.get("kernel_id")
        path = body.get("path")
        if kernel_id is not None and not isinstance(kernel_id, str):
            raise ValueError("kernel_id must be a string.")
        if path is not None and not isinstance(path, str):
            raise ValueError("path must be a string.")
        job = self.manager.restore(snapshot_id, kernel_id=kernel_id, path=path)
        # Answered once the snapshot's manifest is checked: a missing snapshot is a 404, an
        # incompatible one a 422; a long download (with progress) and the hash checks
        # are the job's.
        await self.manager.wait_checked(job)
        self.reply({"job": job.to_dict()}, status=202)


class JobHandler(SnapshotHandler):
    @web.authenticated
    @authorized
    async def get(self, job_id: str) -> None:
        self.reply(self.manager.job(job_id).to_dict())


class KernelsHandler(SnapshotHandler):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        self.reply({"kernels": await self.manager.kernels()})


class KernelHandler(SnapshotHandler):
    @web.authenticated
    @authorized
    async def get(self, kernel_id: str) -> None:
        self.reply(await self.manager.kernel_status(self._known(kernel_id)))

    @web.authenticated
    @authorized
    async def patch(self, kernel_id: str) -> None:
        """Per-kernel choices: ``{"periodic": false}`` opts a kernel out of periodic snapshots."""
        kernel_id = self._known(kernel_id)
        body = self.body()
        if "periodic" in body:
            if not isinstance(body["periodic"], bool):
                raise ValueError("periodic must be true or false.")
            if body["periodic"]:
                self.manager.periodic_opt_out.discard(kernel_id)
            else:
                self.manager.periodic_opt_out.add(kernel_id)
        self.reply(await self.manager.kernel_status(kernel_id))

    def _known(self, kernel_id: str) -> str:
        self.manager._kernel(kernel_id)
        return kernel_id


class SuspendHandler(SnapshotHandler):
    @web.authenticated
    @authorized
    async def post(self, kernel_id: str, action: str) -> None:
        if action == "suspend":
            job = self.manager.suspend(kernel_id, trigger="manual")
        else:
            job = self.manager.resume(kernel_id)
        self.reply({"job": job.to_dict()}, status=202)


class PolicyHandler(SnapshotHandler):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        self.reply(self.policy)


def route_table(
    manager: SnapshotManager, policy: dict[str, Any]
) -> list[tuple[str, type[SnapshotHandler], dict[str, Any]]]:
    """The routes, relative to the server's base_url (ExtensionApp prepends it)."""
    kwargs = {"manager": manager, "policy": policy}
    routes: list[tuple[str, type[SnapshotHandler]]] = [
        (r"/api/snapshots", SnapshotsHandler),
        (r"/api/snapshots/policy", PolicyHandler),
        (r"/api/snapshots/kernels", KernelsHandler),
        (rf"/api/snapshots/kernels/{KERNEL_ID}", KernelHandler),
        (rf"/api/snapshots/kernels/{KERNEL_ID}/(?P<action>suspend|resume)", SuspendHandler),
        (rf"/api/snapshots/jobs/{JOB_ID}", JobHandler),
        (rf"/api/snapshots/{SNAPSHOT_ID}/restore", RestoreHandler),
        (rf"/api/snapshots/{SNAPSHOT_ID}", SnapshotItemHandler),
    ]
    return [(pattern, handler, kwargs) for pattern, handler in routes]
