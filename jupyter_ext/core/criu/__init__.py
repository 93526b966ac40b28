"""CRIU, by concern: finding and running it (:mod:`.engine`), the options of a dump and a
restore (:mod:`.options`), copies made while the tree is frozen (:mod:`.frozen`), a lazy
restore's page transfer (:mod:`.lazy`), the dumped tree's working directories
(:mod:`.workdirs`), its images (:mod:`.images`) and what its logs say (:mod:`.log`).

The names the rest of the product uses are handed on here, as ``gpu/`` and
``lazypages/`` do; the parts import each other directly.
"""

from .engine import REQUIRED_FEATURES, Criu, parse_version
from .frozen import FrozenCopy, FrozenStep
from .lazy import UNPRIVILEGED_NO_LAZY, LazyTransfer, check_asked
from .log import UNPRIVILEGED_CAPS, frozen_seconds, port_taken
from .options import DEFAULT_GHOST_LIMIT, TCP_DUMP_OPTIONS, external_file_key, unprivileged

__all__ = [
    "DEFAULT_GHOST_LIMIT",
    "REQUIRED_FEATURES",
    "TCP_DUMP_OPTIONS",
    "UNPRIVILEGED_CAPS",
    "UNPRIVILEGED_NO_LAZY",
    "Criu",
    "FrozenCopy",
    "FrozenStep",
    "LazyTransfer",
    "check_asked",
    "external_file_key",
    "frozen_seconds",
    "parse_version",
    "port_taken",
    "unprivileged",
]
