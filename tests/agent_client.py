"""What a stand-in pod runs to talk to the node agent (tests/agentpods.py): the product's
own client (core/agent/client.py), one operation per run, its answer as one JSON line.

    python -m tests.agent_client SOCKET hello
    python -m tests.agent_client SOCKET dump PID IMAGES_DIR [--end] [--ghost-limit=BYTES]
    python -m tests.agent_client SOCKET restore IMAGES_DIR
    python -m tests.agent_client SOCKET raw JSON          (a request as given, for refusals)
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import time
from pathlib import Path
from typing import Any

from jupyter_ext.core.agent.client import AgentCriu
from jupyter_ext.core.agent.protocol import receive
from jupyter_ext.core.errors import SnapshotError


def main(argv: list[str]) -> dict[str, Any]:
    path, op, *rest = argv
    if op == "raw":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.connect(path)
        sock.sendall(rest[0].encode())
        data, _ = receive(sock)
        answer: dict[str, Any] = json.loads(data)
        return answer
    try:
        criu = AgentCriu.connect(Path(path))
        if op == "hello":
            return {"ok": True, "source": criu.source, "version": criu.version_text}
        if op == "dump":
            images = Path(rest[1])
            images.mkdir()
            ghost = [int(a.split("=")[1]) for a in rest if a.startswith("--ghost-limit=")]
            dumping = criu.dump(
                int(rest[0]),
                images,
                images,
                leave_running="--end" not in rest,
                ghost_limit=ghost[0] if ghost else 0,
            )
            started = time.monotonic()
            frozen = asyncio.run(dumping)
            return {"ok": True, "frozen_seconds": frozen, "seconds": time.monotonic() - started}
        if op == "restore":
            pid = asyncio.run(criu.restore(Path(rest[0]), Path(rest[0])))
            return {"ok": True, "pid": pid}
    except SnapshotError as exc:
        return {"ok": False, "error": exc.to_dict()}
    raise SystemExit(f"unknown operation {op}")


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])))
