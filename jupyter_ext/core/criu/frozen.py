"""Copies made while CRIU holds the dumped tree frozen (its /dev/shm files, its appended
logs: core/carried/), so that they match its memory image: a lock held is held, a log's
size is the one CRIU recorded.

CRIU stops at its ``post-dump`` step, the last before the tree runs again, and asks
whoever runs it. CRIU run by this process executes :meth:`FrozenCopy.action_script`
(``--action-script``), which asks through two FIFOs and waits for the answer. The node
agent's CRIU is asked over its RPC socket instead and passes the question on to its
caller (core/agent/client.py), which calls :meth:`FrozenCopy.run`. A failed copy makes
CRIU fail the dump: the tree runs on, unharmed.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from pathlib import Path
from typing import Protocol

_SCRIPT = """\
#!/bin/sh
[ "$CRTOOLS_SCRIPT_ACTION" = post-dump ] || exit 0
echo go > '{request}'
read answer < '{answer}'
[ "$answer" = ok ]
"""


class FrozenStep(Protocol):
    """Something copied while CRIU holds the tree frozen."""

    def copy(self) -> None: ...


class FrozenCopy:
    """Runs the ``steps`` (copies into the snapshot) while CRIU keeps the tree frozen."""

    def __init__(self, steps: list[FrozenStep]) -> None:
        self.steps = steps
        self.error: OSError | None = None
        self.copied = False
        self.seconds = 0.0
        """How long the copy held the frozen tree."""
        self._fifos: tuple[Path, Path] | None = None
        """The action script's request and answer."""
        self._thread: threading.Thread | None = None

    def run(self) -> bool:
        """Copy now (the tree is frozen): whether every step succeeded."""
        started = time.monotonic()
        try:
            for step in self.steps:
                step.copy()
            self.copied = True
        except OSError as exc:
            self.error = exc
        self.seconds = time.monotonic() - started
        return self.error is None

    def action_script(self, work_dir: Path) -> str:
        """A script for ``criu --action-script`` that, at ``post-dump``, has a thread here
        :meth:`run` and answers with its outcome; :meth:`finish` after CRIU ended."""
        request, answer = work_dir / "frozen-copy.request", work_dir / "frozen-copy.answer"
        os.mkfifo(request, 0o600)
        os.mkfifo(answer, 0o600)
        self._fifos = request, answer
        script = work_dir / "frozen-copy.sh"
        script.write_text(_SCRIPT.format(request=request, answer=answer))
        script.chmod(0o700)  # CRIU executes it directly
        self._thread = threading.Thread(
            target=self._serve, args=self._fifos, name="frozen-copy", daemon=True
        )
        self._thread.start()
        return str(script)

    def _serve(self, request: Path, answer: Path) -> None:
        with open(request, "rb") as asked:
            if asked.read().strip() != b"go":
                return  # the dump ended before its post-dump step
        outcome = b"ok\n" if self.run() else b"fail\n"
        with contextlib.suppress(OSError), open(answer, "wb") as out:
            out.write(outcome)  # fails only if the script is gone (CRIU killed)

    def finish(self) -> None:
        """After CRIU ended: release a thread still waiting for a script that never ran."""
        if self._thread is None or self._fifos is None or not self._thread.is_alive():
            return
        request, answer = self._fifos
        with contextlib.suppress(OSError):
            fd = os.open(request, os.O_WRONLY | os.O_NONBLOCK)
            os.write(fd, b"cancel\n")
            os.close(fd)
        with contextlib.suppress(OSError):
            os.close(os.open(answer, os.O_RDONLY | os.O_NONBLOCK))
        self._thread.join(timeout=5)
