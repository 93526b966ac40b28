from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from jupyter_ext.core.criu import Criu
from jupyter_ext.core.errors import CriuNotFoundError

from .harness import KernelProcess


@pytest.fixture(scope="session")
def criu() -> Criu:
    """The CRIU the product would use. Missing CRIU is an error, not a skip: CI installs it."""
    if os.geteuid() != 0:
        pytest.fail("these tests run CRIU and need root")
    try:
        return Criu.locate()
    except CriuNotFoundError as exc:
        pytest.fail(str(exc))


@pytest.fixture
def kernel_factory(tmp_path: Path, criu: Criu) -> Iterator[Callable[..., KernelProcess]]:
    """Start snapshot kernels; every one is torn down (kill -9 if need be) after the test."""
    started: list[KernelProcess] = []

    def start(**kwargs: Any) -> KernelProcess:
        kernel = KernelProcess(tmp_path / "kernels", **kwargs)
        started.append(kernel)
        return kernel

    yield start
    for kernel in started:
        if kernel.process.poll() is None:
            kernel.kill_all()
        else:
            kernel.close()


pytest_plugins = ["pytest_jupyter.jupyter_server", "tests.jupyter_api"]
