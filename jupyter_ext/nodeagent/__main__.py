"""``jupyter-snapshot-agent``: run the node agent (as root, unconfined, in the node's PID
namespace: deploy/agent/agent.yaml, docs/agent.md)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from jupyter_ext.core.agent import peers
from jupyter_ext.core.agent.protocol import DEFAULT_SOCKET_DIR
from jupyter_ext.core.criu import Criu
from jupyter_ext.core.errors import SnapshotError

from .seal import ImageSetSealer
from .server import KEEP_FREE_FRACTION, Agent, Limits


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="jupyter-snapshot-agent",
        description="Dump and restore Jupyter kernels for the user pods of this node.",
    )
    parser.add_argument(
        "--socket-dir",
        type=Path,
        default=Path(DEFAULT_SOCKET_DIR),
        help=f"where agent.sock is made (default {DEFAULT_SOCKET_DIR}); user pods get this "
        "directory through the CSI volume",
    )
    parser.add_argument(
        "--state-dir",
        type=Path,
        default=Path("/var/lib/jupyter-kernel-snapshots-agent"),
        help="the agent's own work directory (images while CRIU writes or reads them)",
    )
    parser.add_argument(
        "--key-file",
        type=Path,
        default=Path("/etc/jupyter-kernel-snapshots-agent/seal.key"),
        help="the key images are sealed with (>= 32 bytes; made if missing, then only this "
        "node's agent restores its images); never mount it into user pods",
    )
    parser.add_argument("--criu", default=None, help="the CRIU binary (default: as found)")
    parser.add_argument(
        "--owner-pattern",
        default=peers.DEFAULT_OWNER_PATTERN,
        help="regular expression for the pods' hostnames (pod names), with a group "
        "'owner': the user, named in messages (images are sealed for the whole pod name); "
        "pods whose names do not match are refused",
    )
    limits = Limits()
    parser.add_argument(
        "--max-connections",
        type=int,
        default=limits.max_connections,
        help=f"connections served at once, from all pods (default {limits.max_connections})",
    )
    parser.add_argument(
        "--max-connections-per-pod",
        type=int,
        default=limits.max_connections_per_pod,
        help=f"connections served at once for one pod (default {limits.max_connections_per_pod})",
    )
    parser.add_argument(
        "--receive-timeout",
        type=float,
        default=limits.receive_timeout,
        help="seconds a caller has to send its whole request once connected "
        f"(default {limits.receive_timeout:g})",
    )
    parser.add_argument(
        "--max-request-bytes",
        type=int,
        default=limits.max_request_bytes,
        help="the most image bytes one restore may bring; default -1: what the state "
        f"directory's disk has free beyond {KEEP_FREE_FRACTION * 100:.0f}%% of its size; "
        "never more than it has free, less what restores under way hold",
    )
    args = parser.parse_args(argv)
    if min(args.max_connections, args.max_connections_per_pod) < 1 or args.receive_timeout <= 0:
        parser.error("--max-connections(-per-pod) and --receive-timeout must be above 0")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    if os.geteuid() != 0:
        print("jupyter-snapshot-agent: run it as root (a privileged container)", file=sys.stderr)
        return 1
    try:
        agent = Agent(
            args.socket_dir,
            args.state_dir,
            ImageSetSealer.from_file(args.key_file),
            Criu.locate(args.criu),
            args.owner_pattern,
            Limits(
                max_connections=args.max_connections,
                max_connections_per_pod=args.max_connections_per_pod,
                receive_timeout=args.receive_timeout,
                max_request_bytes=args.max_request_bytes,
            ),
        )
    except SnapshotError as exc:
        print(f"jupyter-snapshot-agent: {exc}", file=sys.stderr)
        return 1
    agent.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
