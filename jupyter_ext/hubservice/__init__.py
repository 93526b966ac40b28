"""The product's JupyterHub service (``python -m jupyter_ext.hubservice``): no user's
server holds bucket credentials; each gets its S3 requests signed for its own prefix, and
its user's key-encryption key (docs/jupyterhub.md)."""
