"""The node agent: one privileged process per node that dumps and restores kernels for
user pods that run at Pod Security "baseline" (docs/agent.md)."""
