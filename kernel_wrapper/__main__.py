"""``python -m kernel_wrapper -f CONNECTION_FILE``: the argv of the snapshot kernelspec."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
from pathlib import Path

from jupyter_ext.core.errors import SnapshotError
from jupyter_ext.core.protocol import DEFAULT_RUNTIME_ROOT

from .wrapper import KernelWrapper

#: Set by the server extension to start a kernel as a restore: the path of a one-shot
#: request file naming the snapshot directory. The wrapper deletes it, so a later restart
#: of the same kernel (same environment) starts fresh, as a restart should.
RESTORE_ENV = "JUPYTER_SNAPSHOT_RESTORE_REQUEST"


def take_restore_request() -> tuple[Path | None, bool, Path | None]:
    """The snapshot directory to start from, whether the requester verified it, and where
    to report a failure (``<request>.result``), from a one-shot request file."""
    request = os.environ.get(RESTORE_ENV)
    if not request:
        return None, False, None
    try:
        data = json.loads(Path(request).read_text())
        Path(request).unlink()
        return Path(data["source"]), bool(data.get("verified")), Path(request + ".result")
    except (OSError, ValueError, KeyError):
        return None, False, None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kernel_wrapper",
        description="Run a snapshot-ready ipykernel behind stable Jupyter channels.",
    )
    parser.add_argument("-f", "--connection-file", required=True, type=Path)
    parser.add_argument(
        "--restore-from",
        type=Path,
        default=None,
        help="start by restoring this snapshot directory instead of a fresh kernel",
    )
    parser.add_argument(
        "--on-inner-death",
        choices=("exit", "wait"),
        default="exit",
        help="when the kernel process dies unexpectedly: exit like ipykernel (the server "
        "restarts it), or wait for a restore and answer requests with an error (default: exit)",
    )
    parser.add_argument("--runtime-dir", type=Path, default=DEFAULT_RUNTIME_ROOT)
    parser.add_argument("--criu", default=None, help="path of the criu binary")
    args, kernel_args = parser.parse_known_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="[kernel_wrapper %(levelname)s] %(message)s", stream=sys.stderr
    )
    restore_from, verified, report = args.restore_from, False, None
    if restore_from is None:
        restore_from, verified, report = take_restore_request()
    wrapper = KernelWrapper(
        args.connection_file,
        runtime_root=args.runtime_dir,
        on_inner_death=args.on_inner_death,
        criu_path=args.criu,
        restore_from=restore_from,
        restore_verified=verified,
        kernel_args=kernel_args,
    )
    try:
        return asyncio.run(wrapper.run())
    except SnapshotError as exc:
        print(f"kernel_wrapper: {exc}", file=sys.stderr)
        if report is not None:
            report.write_text(json.dumps({"error": exc.to_dict()}))
        return 2


if __name__ == "__main__":
    sys.exit(main())
