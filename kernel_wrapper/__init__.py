"""The kernel wrapper: runs a snapshot-ready ipykernel behind stable Jupyter channels."""
