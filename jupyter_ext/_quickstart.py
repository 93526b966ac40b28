"""Imported first by the command line, before jupyter_server: a quicker start.

jupyter_server validates its event schemas with jsonschema, whose format checkers import
``rfc3987_syntax`` when it is installed, and that module compiles some 35 parsers as it is
imported: 1.7 s of every ``jupyter snapshot`` command's start, for a format ("iri") no
schema here uses (python-jsonschema/jsonschema#1428). Marked missing in this process,
jsonschema leaves that one format unchecked; nothing else changes.
"""

from __future__ import annotations

import sys

sys.modules.setdefault("rfc3987_syntax", None)  # type: ignore[arg-type]
