"""The snapshot core: CRIU engine, manifest and stores, with no Jupyter imports."""
