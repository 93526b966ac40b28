"""``python -m jupyter_ext.hubservice``: the command of the hub's managed service."""

from .app import main

main()
