"""``python -m kernel_wrapper -f CONNECTION_FILE``: the argv of the snapshot kernelspec."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path

from jupyter_ext.core.errors import SnapshotError
from jupyter_ext.core.protocol.control import EXIT_PORT_IN_USE, take_await_marker
from jupyter_ext.core.protocol.environment import DEFAULT_RUNTIME_ROOT

from .channels import PortInUseError
from .wrapper import KernelWrapper


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kernel_wrapper",
        usage="python -m kernel_wrapper -f CONNECTION_FILE [options] [-- KERNEL ARGV]",
        description="Run a snapshot-ready ipykernel behind stable Jupyter channels, or, "
        "given after '--', another kernel's command line (its kernelspec's argv; "
        "'jupyter snapshot install-kernelspec --wrap NAME' writes such a kernelspec).",
    )
    parser.add_argument("-f", "--connection-file", required=True, type=Path)
    parser.add_argument(
        "--on-inner-death",
        choices=("exit", "wait"),
        default="exit",
        help="when the kernel process dies unexpectedly: exit like ipykernel (the server "
        "restarts it), or wait for a restore and answer requests with an error (default: exit)",
    )
    parser.add_argument("--runtime-dir", type=Path, default=DEFAULT_RUNTIME_ROOT)
    parser.add_argument("--criu", default=None, help="path of the criu binary")
    own = sys.argv[1:] if argv is None else argv
    kernel_argv: list[str] = []
    if "--" in own:
        at = own.index("--")
        own, kernel_argv = own[:at], own[at + 1 :]
    args, kernel_args = parser.parse_known_args(own)
    # What the wrapper and its CRIU write (images, manifests, logs: the kernel's whole
    # memory) is the user's alone whatever their umask; the kernel keeps the user's.
    kernel_umask = os.umask(0o077)
    logging.basicConfig(
        level=logging.INFO,
        format="[kernel_wrapper %(levelname)s %(asctime)s.%(msecs)03d] %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
        stream=sys.stderr,
    )
    try:
        wrapper = KernelWrapper(
            args.connection_file,
            runtime_root=args.runtime_dir,
            on_inner_death=args.on_inner_death,
            criu_path=args.criu,
            # Started by the server for a restore into a new kernel (also the test harness's).
            await_restore=take_await_marker(dict(os.environ)),
            kernel_args=kernel_args,
            kernel_argv=kernel_argv,
            kernel_umask=kernel_umask,
        )
        return asyncio.run(wrapper.run())
    except SnapshotError as exc:
        print(f"kernel_wrapper: {exc}", file=sys.stderr)
        return EXIT_PORT_IN_USE if isinstance(exc, PortInUseError) else 2


if __name__ == "__main__":
    sys.exit(main())
