"""When the server acts on snapshots by itself: pure decisions, tested without kernels.

- :mod:`.tick`: what one policy tick does (periodic, long-cell, idle suspend, culled);
- :mod:`.retention`: which stored snapshots retention deletes.
"""
