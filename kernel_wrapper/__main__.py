"""``python -m kernel_wrapper -f CONNECTION_FILE``: the argv of the snapshot kernelspec."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

from jupyter_ext.core.errors import SnapshotError
from jupyter_ext.core.protocol import DEFAULT_RUNTIME_ROOT, ENV_RESTORE_REQUEST, RestoreRequest

from .wrapper import KernelWrapper


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
    restore, request = None, None
    if args.restore_from is not None:
        restore = RestoreRequest(args.restore_from)
    elif os.environ.get(ENV_RESTORE_REQUEST):
        request = Path(os.environ[ENV_RESTORE_REQUEST])
        restore = RestoreRequest.take(request)
    wrapper = KernelWrapper(
        args.connection_file,
        runtime_root=args.runtime_dir,
        on_inner_death=args.on_inner_death,
        criu_path=args.criu,
        restore=restore,
        kernel_args=kernel_args,
    )
    try:
        return asyncio.run(wrapper.run())
    except SnapshotError as exc:
        print(f"kernel_wrapper: {exc}", file=sys.stderr)
        if request is not None and restore is not None:
            try:
                RestoreRequest.report_failure(request, exc)
            except OSError as write_error:
                print(f"kernel_wrapper: cannot report it: {write_error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
