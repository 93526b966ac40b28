"""The product's wires, one module each (docs/architecture.md):

- :mod:`.environment`: the environment variables server, wrappers and kernels share;
- :mod:`.progress`: the phases of a job and a progress report (wrapper, store, manager);
- :mod:`.control`: the server's control protocol to each kernel wrapper;
- :mod:`.inner`: the wire between a wrapper and its inner kernel.

The node agent's protocol is core/agent/protocol.py.
"""
