"""A stored snapshot's memory lent to a lazy restore."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from ..core.lazypages import PrefixedPages, RangeServer
from ..core.manifest import IMAGES_DIR
from ..core.store import StoredImages


class LentPages:
    """A stored snapshot's memory lent to the wrapper that restores it lazily: the
    store's verified ranges, served on a unix socket in a private folder (the wrapper is
    another process; socket paths must stay short)."""

    def __init__(self, snapshot_id: str, images: StoredImages) -> None:
        self.snapshot_id = snapshot_id
        self.images = images
        self.folder = Path(tempfile.mkdtemp(prefix="jks-pages-"))
        try:
            self.server = RangeServer(
                PrefixedPages(images, f"{IMAGES_DIR}/"), self.folder / "pages.sock"
            )
        except BaseException:
            shutil.rmtree(self.folder, ignore_errors=True)
            raise

    @property
    def address(self) -> str:
        return self.server.address

    def close(self) -> None:
        self.server.close()
        self.images.close()
        shutil.rmtree(self.folder, ignore_errors=True)
