"""Take variables back from a snapshot into a running kernel, without replacing it.

A CRIU image cannot be read from outside: only the restored process knows its objects.
So the snapshot is restored as a *side kernel* on this server (attached to no notebook),
the chosen variables are serialised there (pickle protocol 5 with out-of-band buffers, so
arrays travel as raw files; cloudpickle, then dill, where plain pickle fails) into a private
directory, and loaded into the target kernel; the side kernel is then stopped.

The target is touched once, at the very end, by one silent execution that unpickles every
variable first and assigns them all only if each one loaded: a failure leaves it as it was.
A name the target has already is replaced only when the request says ``overwrite`` (the
panel asks first): without it, the request is refused naming those variables.
A variable that cannot be serialised fails the job before the target is touched at all,
naming the variable and the reason. GPU tensors come back on the device they were on; a
target without it fails with the framework's reason and a hint.
"""

from __future__ import annotations

import ast
import json
import keyword
import logging
import shutil
from typing import TYPE_CHECKING, Any

from .core import private
from .core.errors import (
    SnapshotBusyError,
    SnapshotNotFoundError,
    VariablesExistError,
    VariableTransferError,
    WrapperUnavailableError,
)
from .core.manifest import check_snapshot_id

if TYPE_CHECKING:
    from .manager import Job, SnapshotManager

log = logging.getLogger(__name__)

#: Seconds a side kernel or the target may take to serialise or load the variables.
EXECUTE_TIMEOUT = 600.0
#: Variables one request may take.
MAX_NAMES = 100

# Runs in the side kernel (a throwaway copy of the snapshot's kernel). Names are checked
# identifiers: they are safe as file names.
_DUMP = """
def __kernel_snapshots_dump(names, outdir):
    import json, os, pickle
    def private(path, flags):  # files 0600 in the 0700 folder, whatever the umask
        return os.open(path, flags, 0o600)
    report = {}
    namespace = globals()
    for name in names:
        if name not in namespace:
            report[name] = {"error": "the snapshot's kernel has no variable of that name"}
            continue
        obj = namespace[name]
        data, how, failures, buffers = None, "", [], []
        for how in ("pickle", "cloudpickle", "dill"):
            buffers = []
            try:
                module = pickle if how == "pickle" else __import__(how)
            except ImportError:
                continue
            try:
                data = module.dumps(obj, protocol=5, buffer_callback=buffers.append)
                break
            except Exception as exc:
                failures.append(f"{how}: {type(exc).__name__}: {exc}")
        if data is None:
            report[name] = {"error": "; ".join(failures) or "no serialiser could write it"}
            continue
        base = os.path.join(outdir, name)
        with open(base + ".pickle", "wb", opener=private) as f:
            f.write(data)
        size = len(data)
        for i, buffer in enumerate(buffers):
            raw = buffer.raw()
            with open(f"{base}.{i}.buffer", "wb", opener=private) as f:
                f.write(raw)
            size += raw.nbytes
        report[name] = {"how": how, "bytes": size, "buffers": len(buffers)}
    with open(os.path.join(outdir, "report.json"), "w", opener=private) as f:
        json.dump(report, f)

try:
    __kernel_snapshots_dump(%(names)r, %(outdir)r)
finally:
    del __kernel_snapshots_dump
"""

# Runs in the target: all variables are unpickled before any is assigned.
_LOAD = """
def __kernel_snapshots_load(outdir, mapping):
    import json, os, pickle
    with open(os.path.join(outdir, "report.json")) as f:
        report = json.load(f)
    loaded = {}
    for source, target in mapping.items():
        entry = report[source]
        base = os.path.join(outdir, source)
        try:
            with open(base + ".pickle", "rb") as f:
                data = f.read()
            buffers = []
            for i in range(entry["buffers"]):
                with open(f"{base}.{i}.buffer", "rb") as f:
                    buffers.append(bytearray(f.read()))
            module = pickle if entry["how"] == "pickle" else __import__(entry["how"])
            loaded[target] = module.loads(data, buffers=buffers)
        except Exception as exc:
            raise RuntimeError(
                json.dumps({"name": source, "reason": f"{type(exc).__name__}: {exc}"})
            ) from None
    globals().update(loaded)

try:
    __kernel_snapshots_load(%(outdir)r, %(mapping)r)
finally:
    del __kernel_snapshots_load
"""


def check_names(names: object, rename: object = None) -> dict[str, str]:
    """{variable in the snapshot: name in the target} from a request; ValueError (400)
    naming what is wrong."""
    if not isinstance(names, list) or not names or len(names) > MAX_NAMES:
        raise ValueError(f"names must be a list of 1 to {MAX_NAMES} variable names.")
    if rename is None:
        rename = {}
    if not isinstance(rename, dict):
        raise ValueError('rename must be an object {"name in the snapshot": "new name"}.')
    mapping: dict[str, str] = {}
    for name in names:
        new = rename.get(name, name) if isinstance(name, str) else None
        for value in (name, new):
            if not isinstance(value, str) or not value.isidentifier() or keyword.iskeyword(value):
                raise ValueError(f"{value!r} is not a Python variable name.")
        mapping[str(name)] = str(new)
    unknown = set(rename) - set(mapping)
    if unknown:
        raise ValueError(f"rename names variables not in names: {', '.join(sorted(unknown))}.")
    if len(set(mapping.values())) != len(mapping):
        raise ValueError("Two variables would get the same name in the target.")
    return mapping


async def execute(
    kernel_manager: Any, kernel_id: str, code: str, expressions: dict[str, str] | None = None
) -> dict[str, Any]:
    """Run ``code`` silently (no output, no history) in a kernel, and evaluate
    ``expressions`` there; its execute_reply."""
    km = kernel_manager.get_kernel(kernel_id)
    client = km.client()
    client.start_channels()
    try:
        await client.wait_for_ready(timeout=60)
        msg_id = client.execute(
            code,
            silent=True,
            store_history=False,
            allow_stdin=False,
            user_expressions=expressions or {},
        )
        while True:
            reply = await client.get_shell_msg(timeout=EXECUTE_TIMEOUT)
            if reply["parent_header"].get("msg_id") == msg_id:
                content: dict[str, Any] = reply["content"]
                return content
    finally:
        client.stop_channels()


async def running_a_cell(manager: SnapshotManager, kernel_id: str) -> bool:
    """Whether the kernel runs a cell: busy, with an execute_request it has not answered.

    Asked of the kernel's wrapper, which records each status and reply before it passes it
    on: a client that has its cell's reply or idle status is never told the cell runs. (The
    server's own ``execution_state`` follows its own iopub subscription, which may get the
    idle status after the client did.) Only a kernel without our wrapper is judged by that.
    """
    km = manager.server_kernels.kernel(kernel_id)
    try:
        status = await manager.server_kernels.wrapper(kernel_id).status()
    except WrapperUnavailableError:
        return getattr(km, "execution_state", "") == "busy"
    running = status.get("running_request", {})  # a wrapper older than the field: busy decides
    return status["execution_state"] == "busy" and running is not None


async def existing(manager: SnapshotManager, kernel_id: str, names: list[str]) -> list[str]:
    """Which of ``names`` the kernel has as variables now (its globals), asked silently."""
    probe = f"[n for n in {names!r} if n in globals()]"
    reply = await execute(manager.kernel_manager, kernel_id, "", {"names": probe})
    answer = reply.get("user_expressions", {}).get("names", {})
    try:
        found = ast.literal_eval(answer["data"]["text/plain"])
    except (KeyError, ValueError, SyntaxError, TypeError):
        raise VariableTransferError(
            f"Kernel {kernel_id} did not say which variables it has: {answer}.",
            hint="Is it a Python kernel? Variables are taken into Python kernels only.",
        ) from None
    return [str(name) for name in found]


async def start(
    manager: SnapshotManager,
    snapshot_id: str,
    kernel_id: str,
    mapping: dict[str, str],
    overwrite: bool = False,
) -> Job:
    """The job that copies ``mapping``'s variables from the snapshot into ``kernel_id``;
    one of a name the kernel has is only replaced with ``overwrite``."""
    check_snapshot_id(snapshot_id)
    if await running_a_cell(manager, kernel_id):
        raise SnapshotBusyError(
            f"Kernel {kernel_id} is running a cell; variables are only loaded into an idle "
            "kernel (the running code could see them change midway).",
            hint="Wait until the cell finishes, or interrupt it, then try again.",
        )
    manager.jobs.check_not_busy(kernel_id)
    try:
        manifest = await manager.snapshots.manifest(snapshot_id)
    except SnapshotNotFoundError:  # else a cell checkpoint of one of its kernels
        checkpoint = await manager.checkpoints.manifest(snapshot_id)
        if checkpoint is None:
            raise
        manifest = checkpoint
    refused = manifest.contents.get("take_unavailable")
    if refused:  # (an unknown snapshot is a 404 first)
        raise VariableTransferError(
            str(refused), hint="Restore the snapshot instead: the whole kernel comes back."
        )
    if not overwrite:
        taken = await existing(manager, kernel_id, list(mapping.values()))
        if taken:
            plural = "s" if len(taken) > 1 else ""
            raise VariablesExistError(
                f"The kernel already has {', '.join(taken)}: taking it back would replace "
                f"the value{plural} it has now.",
                hint="Take it under a new name, or ask to overwrite (overwrite: true; "
                "jupyter snapshot take --overwrite).",
            )

    async def work(job: Job) -> dict[str, Any]:
        return await _take(manager, job, snapshot_id, kernel_id, mapping)

    return manager.jobs.start("variables", kernel_id, work)


async def _take(
    manager: SnapshotManager, job: Job, snapshot_id: str, target: str, mapping: dict[str, str]
) -> dict[str, Any]:
    outdir = private.make_dirs(manager.work_dir / "variables" / job.id)
    side: str | None = None
    try:
        # A cell checkpoint of one of the server's kernels, else a snapshot.
        restored = await manager.checkpoints.restore_side_kernel(
            job, snapshot_id
        ) or await manager.restores.restore_side_kernel(job, snapshot_id)
        side = str(restored["kernel_id"])
        if restored.get("running_request"):
            # The cell running at the snapshot goes on in the side kernel; the pickling
            # would wait behind it (forever, for a cell that never ends): interrupt it.
            await manager.kernel_manager.interrupt_kernel(side)
        manager.jobs.progress(job, "serialising")
        reply = await execute(
            manager.kernel_manager, side, _DUMP % {"names": list(mapping), "outdir": str(outdir)}
        )
        if reply.get("status") != "ok":
            raise VariableTransferError(
                "The snapshot's kernel could not write the variables: "
                f"{reply.get('ename')}: {reply.get('evalue')}.",
                hint="This is a bug if it repeats; the server's log has the details.",
            )
        report = json.loads((outdir / "report.json").read_text())
        failed = {name: entry["error"] for name, entry in report.items() if "error" in entry}
        if failed:
            reasons = "; ".join(f"{name}: {reason}" for name, reason in failed.items())
            raise VariableTransferError(
                f"Variables that cannot be taken from snapshot {snapshot_id}: {reasons}. "
                "Nothing was loaded into the kernel.",
                hint="Take the other variables alone, or restore the whole snapshot (a restore "
                "brings back everything, whatever pickle thinks of it).",
            )
        await _stop(manager, side)
        side = None
        manager.jobs.progress(job, "loading")
        reply = await execute(
            manager.kernel_manager,
            target,
            _LOAD % {"outdir": str(outdir), "mapping": mapping},
        )
        if reply.get("status") != "ok":
            raise _load_error(reply, target)
        return {
            "kernel_id": target,
            "snapshot_id": snapshot_id,
            "variables": [
                {
                    "name": name,
                    "as": new,
                    "how": report[name]["how"],
                    "bytes": report[name]["bytes"],
                }
                for name, new in mapping.items()
            ],
        }
    finally:
        if side is not None:
            await _stop(manager, side)
        shutil.rmtree(outdir, ignore_errors=True)


def _load_error(reply: dict[str, Any], target: str) -> VariableTransferError:
    """The error of a failed load, naming the variable when the loader could."""
    try:
        detail = json.loads(str(reply.get("evalue")))
        name, reason = detail["name"], detail["reason"]
    except (ValueError, KeyError, TypeError):
        name, reason = "?", f"{reply.get('ename')}: {reply.get('evalue')}"
    hint = "The kernel is unchanged: no variable was assigned."
    if "cuda" in reason.lower() or "gpu" in reason.lower() or "device" in reason.lower():
        hint += (
            " The variable lives on a GPU that kernel " + target + " does not have: take it "
            "into a kernel on a GPU machine, or move it to the CPU in the snapshot first."
        )
    else:
        hint += " Install in the kernel's environment what the variable's type needs."
    return VariableTransferError(
        f"Variable {name!r} could not be loaded into kernel {target}: {reason}.", hint=hint
    )


async def _stop(manager: SnapshotManager, kernel_id: str) -> None:
    try:
        await manager.kernel_manager.shutdown_kernel(kernel_id, now=True)
    except Exception:
        log.warning("could not stop the side kernel %s", kernel_id, exc_info=True)
