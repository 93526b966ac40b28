"""Every environment variable the product's processes share, named once: set by the
operator, by the server for the wrappers it starts, or by a wrapper for its kernel."""

from __future__ import annotations

import os
from pathlib import Path

#: Set by the operator: where wrappers make their private
#: directories, which CRIU (or where its private copy lives), which libcuda and
#: cuda-checkpoint.
ENV_RUNTIME_DIR = "JUPYTER_SNAPSHOT_RUNTIME_DIR"
ENV_CRIU = "JUPYTER_SNAPSHOT_CRIU"
ENV_CRIU_PREFIX = "JUPYTER_SNAPSHOT_CRIU_PREFIX"
ENV_LIBCUDA = "JUPYTER_SNAPSHOT_LIBCUDA"
ENV_CUDA_CHECKPOINT = "JUPYTER_SNAPSHOT_CUDA_CHECKPOINT"
#: Set by the server for the snapshot kernels it starts: "0" turns lazy restore off
#: (SnapshotExtensionApp.lazy_restore).
ENV_LAZY_RESTORE = "JUPYTER_SNAPSHOT_LAZY_RESTORE"
#: Set by the server (SnapshotExtensionApp.lazy_restore_min_bytes): a kernel restored
#: from local images is restored lazily only from this much memory on.
ENV_LAZY_RESTORE_MIN_BYTES = "JUPYTER_SNAPSHOT_LAZY_RESTORE_MIN_BYTES"
#: Set by the server (SnapshotExtensionApp.kernel_pid_floor): without root, a wrapper moves
#: its PID namespace's counter past this before it starts a kernel (core/isolation/pidspace.py).
ENV_PID_FLOOR = "JUPYTER_SNAPSHOT_PID_FLOOR"
#: Set by the server for a kernel it restores into: the path of a one-shot marker file
#: that makes the new kernel's wrapper start without a kernel and wait for a ``restore``
#: operation, at most control.AWAIT_RESTORE_SECONDS. The wrapper removes the marker, so a
#: later restart of that kernel (same environment) starts fresh.
ENV_AWAIT_RESTORE = "JUPYTER_SNAPSHOT_AWAIT_RESTORE"
#: Set by the server for the snapshot kernels it starts: its cell checkpoint settings, as
#: JSON (core/checkpoints/settings.py's CheckpointSettings); unset: no cell checkpoints.
ENV_CELL_CHECKPOINTS = "JUPYTER_SNAPSHOT_CELL_CHECKPOINTS"
#: Set by the wrapper for its inner kernel: the private directory of its channels.
ENV_INNER_DIR = "JUPYTER_SNAPSHOT_INNER_DIR"
#: Set (to "1") by a wrapper with root for its inner kernel: mount a /proc of the kernel's
#: own PID namespace in its own mount namespace (core/isolation/mountns.py).
ENV_OWN_PROC = "JUPYTER_SNAPSHOT_OWN_PROC"
#: Set in the user pod (deploy/z2jh/config.yaml): the node agent's socket. Set, the kernel
#: wrappers dump and restore through the agent instead of running CRIU themselves.
ENV_AGENT_SOCKET = "JUPYTER_SNAPSHOT_AGENT_SOCKET"
#: Set by the operator (encryption_key_source "env"): the store's KEK (32 bytes, base64),
#: and the older ones, comma-separated, still accepted to unwrap.
ENV_KEY = "JUPYTER_SNAPSHOT_KEY"
ENV_PREVIOUS_KEYS = "JUPYTER_SNAPSHOT_KEY_PREVIOUS"
#: Set by the server for itself and its wrappers: glibc malloc tuning (jupyter_ext/memory.py).
ENV_TUNING = "JUPYTER_SNAPSHOT_MALLOC_TUNING"

#: Where wrappers make their private directories ($JUPYTER_SNAPSHOT_RUNTIME_DIR overrides).
DEFAULT_RUNTIME_ROOT = Path(
    os.environ.get(ENV_RUNTIME_DIR)
    or (
        "/run/jupyter-kernel-snapshots"
        if os.geteuid() == 0
        else f"/tmp/jupyter-kernel-snapshots-{os.geteuid()}"
    )
)
