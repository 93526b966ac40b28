"""Where a notebook is now: the renames and moves of notebooks (and folders) this server
made, kept in the work directory so that they outlast it. A snapshot keeps the path it was
taken at; through these, "the snapshots of demo.ipynb" are also those taken while it was
Untitled.ipynb, and a restore of one of them goes to demo.ipynb, also after the kernel
that took them is gone (a node lost, a server restarted)."""

from __future__ import annotations

import inspect
import json
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from ..core import private

log = logging.getLogger("jupyter_ext")

#: Renames remembered (the oldest are forgotten first).
MAX_RENAMES = 10_000


class NotebookPaths:
    """Renames, oldest first, as (old path, new path), files and folders alike."""

    def __init__(self, file: Path) -> None:
        self.file = file
        self.renames: list[tuple[str, str]] = []
        try:
            self.renames = [(str(a), str(b)) for a, b in json.loads(file.read_text())]
        except FileNotFoundError:
            pass
        except (OSError, ValueError, TypeError) as exc:
            log.warning(
                "kernel snapshots: the notebooks' renames in %s are unreadable: %s", file, exc
            )

    def moved(self, old: str, new: str) -> None:
        """``old`` (a notebook or a folder) is ``new`` from now on."""
        old, new = old.strip("/"), new.strip("/")
        if old == new:
            return
        self.renames = [*self.renames, (old, new)][-MAX_RENAMES:]
        try:
            private.make_dirs(self.file.parent)
            private.write_file(
                self.file.with_name(self.file.name + ".tmp"), json.dumps(self.renames)
            )
            self.file.with_name(self.file.name + ".tmp").replace(self.file)
        except OSError as exc:
            log.warning("kernel snapshots: cannot keep the rename of %s: %s", old, exc)

    def now(self, path: str | None) -> str | None:
        """Where the notebook that was at ``path`` is now (``path`` if never moved)."""
        if not path:
            return path
        for old, new in self.renames:
            if path == old:
                path = new
            elif path.startswith(old + "/"):  # a folder above it moved
                path = new + path[len(old) :]
        return path

    def install(self, contents_manager: Any) -> None:
        """Hear the contents manager's renames (jupyter_server's PATCH /api/contents: the
        file browser's rename and move, JupyterLab's first save of an Untitled notebook):
        its ``rename`` is wrapped on the instance, as it is (sync or async)."""
        rename: Callable[[str, str], Any] = contents_manager.rename
        if inspect.iscoroutinefunction(rename):

            async def renamed_async(old_path: str, new_path: str) -> Any:
                done: Awaitable[Any] = rename(old_path, new_path)
                result = await done
                self.moved(old_path, new_path)
                return result

            contents_manager.rename = renamed_async
        else:

            def renamed(old_path: str, new_path: str) -> Any:
                result = rename(old_path, new_path)
                self.moved(old_path, new_path)
                return result

            contents_manager.rename = renamed
