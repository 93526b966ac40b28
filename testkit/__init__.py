"""The harness the tests and the benchmarks share: real snapshot kernels, servers and S3
(:mod:`testkit.processes`), stand-in pods for the node agent (:mod:`testkit.agentpods`).

Not in the wheel (pyproject.toml lists the shipped packages), and no shipped package
imports it (tests/test_shape.py checks): the product holds only the product. Importable
from the repository root, which the editable install puts on the venv's path."""
