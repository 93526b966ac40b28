"""``python testkit/quickserver.py ARGS``: ``python -m jupyter_server ARGS``, started as
the ``jupyter snapshot`` command starts (jupyter_ext/_quickstart.py): without jsonschema's
optional IRI checker, which no Jupyter schema uses and which costs 2.5 s of CPU at every
server start here, hundreds of them in a test run. The servers of the UI tests, the hub's
and the pods' start as installed, with it."""

from __future__ import annotations

import runpy

import jupyter_ext._quickstart  # noqa: F401  (before jupyter_server)

if __name__ == "__main__":
    runpy.run_module("jupyter_server", run_name="__main__", alter_sys=True)
