"""REST API under /api/snapshots (see openapi.yaml beside this module).

Every verb is authenticated and authorized on the ``kernels`` resource; the routes take
any id in a path segment (``[^/]+``) and the manager checks it (a malformed id is a 400,
an unknown one a 404); domain errors become HTTP errors with the cause and what to do, in
one place (:data:`HTTP_STATUS`, :meth:`SnapshotHandler.write_error`).
"""

from __future__ import annotations

import json
from http.client import responses
from types import TracebackType
from typing import Any

from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from tornado import web

from . import variables
from .core.errors import (
    BadIdError,
    CriuNotFoundError,
    DumpError,
    IncompatibleSnapshotError,
    KernelNotRunningError,
    NotFoundError,
    NothingToUndoError,
    RestoreError,
    SnapshotBusyError,
    SnapshotCorruptError,
    SnapshotError,
    VariablesExistError,
    VariableTransferError,
    WrapperUnavailableError,
)
from .core.gpu import GpuCheckpointError, GpuUnavailableError
from .core.manifest import TRIGGERS
from .core.protocol.control import UndoArgs
from .core.store import StoreError
from .manager import SnapshotManager, validate_notebook_path

#: The HTTP status of each domain error, the first class that matches (a subclass before
#: its base); anything else is a 500. jupyter_ext/openapi.yaml says the same.
HTTP_STATUS: dict[type[SnapshotError], int] = {
    BadIdError: 400,
    NotFoundError: 404,
    VariablesExistError: 409,
    VariableTransferError: 422,
    SnapshotBusyError: 409,
    KernelNotRunningError: 409,
    NothingToUndoError: 409,
    WrapperUnavailableError: 409,
    DumpError: 409,
    SnapshotCorruptError: 422,
    IncompatibleSnapshotError: 422,
    CriuNotFoundError: 503,
    RestoreError: 500,
    StoreError: 503,
    # No CUDA checkpoint support on this machine (libcuda, driver, cuda-checkpoint): as
    # for CRIU, the service is missing here. A GPU the snapshot cannot run on is an
    # IncompatibleSnapshotError (422).
    GpuUnavailableError: 503,
    # A CUDA step refused the kernel now (a lock timed out under a running GPU kernel,
    # out of memory, a process in the wrong state): like a failed dump, try again later.
    GpuCheckpointError: 409,
}
SNAPSHOT_ID = r"(?P<snapshot_id>[^/]+)"
KERNEL_ID = r"(?P<kernel_id>[^/]+)"
JOB_ID = r"(?P<job_id>[^/]+)"
API_HINT = "The REST API is described in jupyter_ext/openapi.yaml."
BODY_HINT = (
    "Send a JSON object (Content-Type: application/json) with the fields the endpoint "
    'takes, e.g. {"kernel_id": "<kernel id>"}. ' + API_HINT
)
#: What to do about the errors jupyter_server and tornado raise before a handler runs.
HTTP_HINTS = {
    400: "Send ids, query arguments and a body as the API takes them (UTF-8, URL-encoded). "
    + API_HINT,
    403: "Authenticate: send the server's token (header 'Authorization: token <token>') or "
    "log in (a cookie session also needs the _xsrf token on POST, PATCH and DELETE); "
    "the user needs permission on the 'kernels' resource.",
    404: "Check the URL. " + API_HINT,
    405: "Use a method the endpoint supports. " + API_HINT,
    500: "This is a bug: the server's log has the details.",
}


class BadRequest(ValueError):
    """Input the API cannot use: a 400 that says what is wrong (message) and what to send."""

    def __init__(self, message: str, hint: str = BODY_HINT) -> None:
        super().__init__(message)
        self.hint = hint


def status_of(error: BaseException | None) -> int | None:
    """The HTTP status of a domain error or of bad input; None for anything else."""
    if isinstance(error, SnapshotError):
        return next((s for cls, s in HTTP_STATUS.items() if isinstance(error, cls)), 500)
    if isinstance(error, ValueError):  # bad input: ids, paths, bodies (manager validates too)
        return 400
    return None


def error_reply(status: int, error: BaseException | None) -> dict[str, str]:
    """The JSON body of every error: ``{message, reason, code, hint, log_excerpt}``, with
    ``reason`` equal to ``code`` (a stable slug, e.g. ``kernel-busy``, ``forbidden``)."""
    if isinstance(error, SnapshotError):
        reply = error.to_dict()
    elif isinstance(error, ValueError):
        hint = error.hint if isinstance(error, BadRequest) else API_HINT
        reply = {"code": "bad-request", "message": str(error), "hint": hint, "log_excerpt": ""}
    else:
        phrase = responses.get(status, "Unknown HTTP Error")
        message = phrase
        if isinstance(error, web.HTTPError) and error.log_message:
            message = error.log_message % error.args if error.args else error.log_message
        elif error is not None:
            message = "Unhandled error: the server's log has the details."
        reply = {
            "code": phrase.lower().replace(" ", "-"),
            "message": message,
            "hint": HTTP_HINTS.get(status, ""),
            "log_excerpt": "",
        }
    return {"message": reply["message"], "reason": reply["code"], **reply}


class SnapshotHandler(APIHandler):
    """Base: the manager comes in through initialize(); errors are turned into HTTP here."""

    auth_resource = "kernels"

    def initialize(self, manager: SnapshotManager, policy: dict[str, Any]) -> None:
        self.manager = manager
        self.policy = policy

    def body(self) -> dict[str, Any]:
        """The request's JSON object. Anything else is a 400 saying why, never a 500: a
        body nested deeper than Python's JSON decoder recurses raises RecursionError,
        which is no ValueError."""
        if not self.request.body:
            return {}
        try:
            data = json.loads(self.request.body)
        except RecursionError:
            raise BadRequest(
                "The request body is nested too deeply to be read (JSON arrays or objects "
                "inside each other, hundreds of levels deep).",
            ) from None
        except ValueError as exc:  # also bytes that are not UTF-8, and huge integers
            raise BadRequest(f"The request body cannot be read as JSON: {exc}") from None
        if not isinstance(data, dict):
            raise BadRequest(f"The request body must be a JSON object, not {type(data).__name__}.")
        return data

    def reply(self, data: Any, status: int = 200) -> None:
        self.set_status(status)
        self.finish(json.dumps(data))

    def send_error(self, status_code: int = 500, **kwargs: Any) -> None:
        """Tornado answers 500 to every exception but HTTPError: domain errors and bad
        input get their own status here."""
        exc_info = kwargs.get("exc_info")
        status = status_of(exc_info[1] if exc_info else None)
        super().send_error(status if status_code == 500 and status else status_code, **kwargs)

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        """Every error, also jupyter_server's 403 and tornado's 404/405, in one JSON shape
        (openapi.yaml's Error)."""
        exc_info = kwargs.get("exc_info")
        self.finish(json.dumps(error_reply(status_code, exc_info[1] if exc_info else None)))

    def log_exception(
        self,
        typ: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        """Domain errors and bad input are answers, not crashes: one line, no traceback."""
        status = status_of(value)
        if status is None:
            super().log_exception(typ, value, tb)
            return
        self.log.warning("%d %s %s: %s", status, self.request.method, self.request.path, str(value))


class SnapshotsHandler(SnapshotHandler):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        path = self.get_query_argument("path", None)
        trigger = self.get_query_argument("trigger", None)
        if trigger is not None and trigger not in TRIGGERS:
            raise BadRequest(
                f"trigger must be one of {', '.join(TRIGGERS)}, not {trigger!r}.", API_HINT
            )
        listing = await self.manager.snapshots.list_snapshots(
            kernel_id=self.get_query_argument("kernel_id", None),
            lineage=self.get_query_argument("lineage", None),
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
            raise BadRequest(
                "kernel_id (a string) is required.",
                'Send {"kernel_id": "<kernel id>"}; GET /api/snapshots/kernels lists them.',
            )
        job = self.manager.kernel_jobs.snapshot(kernel_id, trigger="manual")
        self.reply({"job": job.to_dict()}, status=202)


class SnapshotItemHandler(SnapshotHandler):
    @web.authenticated
    @authorized
    async def get(self, snapshot_id: str) -> None:
        self.reply(await self.manager.snapshots.get(snapshot_id))

    @web.authenticated
    @authorized
    async def delete(self, snapshot_id: str) -> None:
        await self.manager.snapshots.delete(snapshot_id)
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
            raise BadRequest(
                "kernel_id must be a string.",
                'Send {"kernel_id": "<kernel id>"} to restore in place of a running kernel.',
            )
        if path is not None and not isinstance(path, str):
            raise BadRequest(
                "path must be a string.",
                'Send {"path": "<notebook path>"} to restore into a new kernel for a notebook.',
            )
        session_id = body.get("session_id")
        if session_id is not None and not isinstance(session_id, str):
            raise BadRequest(
                "session_id must be a string.",
                'Send {"path": "<notebook path>", "session_id": "<its session id>"}.',
            )
        job = self.manager.restores.restore(
            snapshot_id, kernel_id=kernel_id, path=path, session_id=session_id
        )
        # Answered once the snapshot's manifest is checked: a missing snapshot is a 404, an
        # incompatible one a 422; a long download (with progress) and the hash checks
        # are the job's.
        await self.manager.jobs.wait_checked(job)
        self.reply({"job": job.to_dict()}, status=202)


class VariablesHandler(SnapshotHandler):
    @web.authenticated
    @authorized
    async def post(self, snapshot_id: str) -> None:
        """Copy variables from the snapshot into a running kernel (jupyter_ext.variables)."""
        body = self.body()
        kernel_id = body.get("kernel_id")
        if not isinstance(kernel_id, str):
            raise BadRequest(
                "kernel_id must name the kernel that gets the variables.",
                'Send {"kernel_id": "<kernel id>", "names": ["df"], "rename": {"df": "df_old"}}.',
            )
        try:
            mapping = variables.check_names(body.get("names"), body.get("rename"))
        except ValueError as exc:
            raise BadRequest(
                str(exc),
                'Send {"kernel_id": "<kernel id>", "names": ["df"], "rename": {"df": "df_old"}}.',
            ) from exc
        overwrite = body.get("overwrite", False)
        if not isinstance(overwrite, bool):
            raise BadRequest(
                "overwrite must be true or false.",
                'Send {"overwrite": true} to replace variables the kernel has.',
            )
        job = await variables.start(self.manager, snapshot_id, kernel_id, mapping, overwrite)
        # As a restore: a missing snapshot is a 404, an incompatible one a 422.
        await self.manager.jobs.wait_checked(job)
        self.reply({"job": job.to_dict()}, status=202)


class JobHandler(SnapshotHandler):
    @web.authenticated
    @authorized
    async def get(self, job_id: str) -> None:
        self.reply(self.manager.jobs.job(job_id).to_dict())


class KernelsHandler(SnapshotHandler):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        self.reply({"kernels": await self.manager.schedules.kernels_status()})


class KernelHandler(SnapshotHandler):
    @web.authenticated
    @authorized
    async def get(self, kernel_id: str) -> None:
        self.reply(await self.manager.schedules.kernel_status(self._known(kernel_id)))

    @web.authenticated
    @authorized
    async def patch(self, kernel_id: str) -> None:
        """Per-kernel choices: ``{"periodic": false}`` opts a kernel out of periodic
        snapshots; ``{"dismiss_death": true}`` ends the offer of a dead kernel's snapshot."""
        body = self.body()
        kernel_id = self._known(kernel_id)
        if "periodic" in body:
            if not isinstance(body["periodic"], bool):
                raise BadRequest(
                    "periodic must be true or false.", 'Send {"periodic": false} to opt out.'
                )
            self.manager.schedules.set_periodic(kernel_id, body["periodic"])
        if "dismiss_death" in body:
            if body["dismiss_death"] is not True:
                raise BadRequest(
                    "dismiss_death must be true.",
                    'Send {"dismiss_death": true} once the kernel\'s death has been seen.',
                )
            self.manager.deaths.dismiss(kernel_id)
        self.reply(await self.manager.schedules.kernel_status(kernel_id))

    def _known(self, kernel_id: str) -> str:
        self.manager.server_kernels.kernel(kernel_id)
        return kernel_id


class SuspendHandler(SnapshotHandler):
    @web.authenticated
    @authorized
    async def post(self, kernel_id: str, action: str) -> None:
        if action == "suspend":
            job = self.manager.kernel_jobs.suspend(kernel_id, trigger="manual")
        else:
            job = self.manager.kernel_jobs.resume(kernel_id)
        self.reply({"job": job.to_dict()}, status=202)


class StoreHandler(SnapshotHandler):
    @web.authenticated
    @authorized
    async def post(self, action: str) -> None:
        """Check the store (``{"read_data": true}``: every chunk read too) or prune it."""
        if action == "check":
            read_data = self.body().get("read_data", False)
            if not isinstance(read_data, bool):
                raise BadRequest(
                    "read_data must be true or false.",
                    'Send {"read_data": true} to read and check every chunk too.',
                )
            job = self.manager.upkeep.check(read_data)
        else:
            job = self.manager.upkeep.prune()
        self.reply({"job": job.to_dict()}, status=202)


class CheckpointsHandler(SnapshotHandler):
    @web.authenticated
    @authorized
    async def get(self, kernel_id: str) -> None:
        """The kernel's cell checkpoints, its position among them and the marks."""
        self.reply(await self.manager.checkpoints.listing(kernel_id))


class CheckpointHandler(SnapshotHandler):
    @web.authenticated
    @authorized
    async def get(self, kernel_id: str, snapshot_id: str) -> None:
        """One cell checkpoint with what it holds (its manifest's record)."""
        self.reply(await self.manager.checkpoints.describe(kernel_id, snapshot_id))


class UndoHandler(SnapshotHandler):
    """``GET``: what an undo (redo) would do; ``POST``: do it (a job)."""

    def _args(self, action: str, fields: dict[str, Any]) -> UndoArgs:
        to, before_cell = fields.get("to"), fields.get("before_cell")
        for name, value in (("to", to), ("before_cell", before_cell)):
            if value is not None and not isinstance(value, str):
                raise BadRequest(
                    f"{name} must be a string.",
                    'Send {"to": "<checkpoint id>"} or {"before_cell": "<cell id>"}, or '
                    "neither to undo the last cell.",
                )
        if action == "redo" and (to or before_cell):
            raise BadRequest(
                "Redo takes no to or before_cell: it goes back to where the undo began."
            )
        if to and before_cell:
            raise BadRequest("Give to or before_cell, not both.")
        return UndoArgs(to=to or None, before_cell=before_cell or None, redo=action == "redo")

    @web.authenticated
    @authorized
    async def get(self, kernel_id: str, action: str) -> None:
        fields = {name: self.get_query_argument(name, None) for name in ("to", "before_cell")}
        args = self._args(action, fields)
        self.reply(await self.manager.checkpoints.preview(kernel_id, args))

    @web.authenticated
    @authorized
    async def post(self, kernel_id: str, action: str) -> None:
        job = self.manager.checkpoints.undo(kernel_id, self._args(action, self.body()))
        self.reply({"job": job.to_dict()}, status=202)


class PolicyHandler(SnapshotHandler):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        self.reply({**self.policy, "key_notice": self.manager.snapshots.key_notice()})


def route_table(
    manager: SnapshotManager, policy: dict[str, Any]
) -> list[tuple[str, type[SnapshotHandler], dict[str, Any]]]:
    """The routes, relative to the server's base_url (ExtensionApp prepends it)."""
    kwargs = {"manager": manager, "policy": policy}
    routes: list[tuple[str, type[SnapshotHandler]]] = [
        (r"/api/snapshots", SnapshotsHandler),
        (r"/api/snapshots/policy", PolicyHandler),
        (r"/api/snapshots/store/(?P<action>check|prune)", StoreHandler),
        (r"/api/snapshots/kernels", KernelsHandler),
        (rf"/api/snapshots/kernels/{KERNEL_ID}", KernelHandler),
        (rf"/api/snapshots/kernels/{KERNEL_ID}/(?P<action>suspend|resume)", SuspendHandler),
        (rf"/api/snapshots/kernels/{KERNEL_ID}/checkpoints", CheckpointsHandler),
        (rf"/api/snapshots/kernels/{KERNEL_ID}/checkpoints/{SNAPSHOT_ID}", CheckpointHandler),
        (rf"/api/snapshots/kernels/{KERNEL_ID}/(?P<action>undo|redo)", UndoHandler),
        (rf"/api/snapshots/jobs/{JOB_ID}", JobHandler),
        (rf"/api/snapshots/{SNAPSHOT_ID}/restore", RestoreHandler),
        (rf"/api/snapshots/{SNAPSHOT_ID}/variables", VariablesHandler),
        (rf"/api/snapshots/{SNAPSHOT_ID}", SnapshotItemHandler),
    ]
    return [(pattern, handler, kwargs) for pattern, handler in routes]
