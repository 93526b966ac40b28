"""A fake ``cuda-checkpoint`` over the stand-in libcuda ($FAKECUDA_LIBCUDA), for tests.

It mimics the command line of NVIDIA's utility (driver 570):
``--get-state --pid P``, ``--get-restore-tid --pid P``,
``--action lock|checkpoint|restore|unlock --pid P [--timeout MS]`` and ``--toggle --pid P``.
With ``FAKECUDA_TOOL_TOGGLE_ONLY=1`` it behaves like the older utility that only toggles.
Errors print ``Could not <action> on process ID <pid>: "<message>"`` and exit 1.
"""

from __future__ import annotations

import argparse
import os
import sys

from jupyter_ext.core.gpu import CudaDriver, GpuCheckpointError, ProcessState

HELP_570 = """CUDA checkpoint and restore utility.
Version 570.86.10. Copyright (C) 2025 NVIDIA Corporation. All rights reserved.

Operations:
--get-state --pid <pid>
--action lock | checkpoint | restore | unlock --pid <pid> [--timeout <ms>]
--toggle --pid <pid>
--get-restore-tid --pid <pid>
"""

HELP_OLD = """CUDA checkpoint and restore utility.
Version 550.54.14. Copyright (C) 2024 NVIDIA Corporation. All rights reserved.

--toggle --pid <pid>
--get-state --pid <pid>
"""


def main() -> int:
    toggle_only = os.environ.get("FAKECUDA_TOOL_TOGGLE_ONLY") == "1"
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--help", "-h", action="store_true")
    parser.add_argument("--get-state", action="store_true")
    parser.add_argument("--get-restore-tid", action="store_true")
    parser.add_argument("--toggle", action="store_true")
    parser.add_argument("--action", choices=["lock", "checkpoint", "restore", "unlock"])
    parser.add_argument("--pid", "-p", type=int)
    parser.add_argument("--timeout", "-t", type=int, default=0)
    args = parser.parse_args()
    if args.help:
        print(HELP_OLD if toggle_only else HELP_570)
        return 0
    if args.action and toggle_only:
        print("unknown option --action", file=sys.stderr)
        return 2
    driver = CudaDriver(os.environ["FAKECUDA_LIBCUDA"])
    what = args.action or ("toggle" if args.toggle else "get state")
    try:
        if args.get_state:
            print(driver.get_state(args.pid).label)
        elif args.get_restore_tid:
            print(driver.restore_thread_id(args.pid))
        elif args.toggle:
            if driver.get_state(args.pid) == ProcessState.RUNNING:
                driver.lock(args.pid, 0)
                driver.checkpoint(args.pid)
            else:
                driver.restore(args.pid)
                driver.unlock(args.pid)
        elif args.action == "lock":
            driver.lock(args.pid, args.timeout)
        elif args.action == "checkpoint":
            driver.checkpoint(args.pid)
        elif args.action == "restore":
            driver.restore(args.pid)
        elif args.action == "unlock":
            driver.unlock(args.pid)
        else:
            print(HELP_570)
            return 2
    except GpuCheckpointError as exc:
        print(
            f'Could not {what} on process ID {args.pid}: "{exc.cuda_error_string}"',
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
