from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from jupyter_ext.core.criu import Criu
from jupyter_ext.core.errors import CriuNotFoundError
from jupyter_ext.testing import KernelProcess, MotoServer

from .s3server import JUICEFS_KEY, CuttableProxy, JuicefsGateway


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """As an ordinary user, tests marked ``needs_root`` are skipped, saying why."""
    if os.geteuid() == 0:
        return
    for item in items:
        marker = item.get_closest_marker("needs_root")
        if marker is not None:
            why = marker.args[0] if marker.args else "needs root"
            item.add_marker(pytest.mark.skip(reason=f"non-root run: {why} (docs/nonroot.md)"))


@pytest.fixture(scope="session")
def criu() -> Criu:
    """The CRIU the product would use. Missing CRIU is an error, not a skip: CI installs it.
    As an ordinary user it must carry the file capabilities of docs/nonroot.md."""
    try:
        found = Criu.locate()
    except CriuNotFoundError as exc:
        pytest.fail(str(exc))
    if os.geteuid() != 0:
        from jupyter_ext.core.doctor import check_criu_capabilities

        check = check_criu_capabilities(found)
        if not check.ok:
            pytest.fail(f"{check.detail} Fix: {check.fix}")
    return found


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
        kernel.end()


pytest_plugins = ["pytest_jupyter.jupyter_server", "tests.jupyter_api"]


@pytest.fixture(scope="session")
def aws_test_env() -> Iterator[None]:
    """Test credentials in boto3's standard chain (and nothing from this machine's AWS
    configuration): any key for moto, the juicefs gateway's root user for it."""
    patch = pytest.MonkeyPatch()
    for name, value in {
        "AWS_ACCESS_KEY_ID": JUICEFS_KEY[0],
        "AWS_SECRET_ACCESS_KEY": JUICEFS_KEY[1],
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": "/nonexistent",
        "AWS_SHARED_CREDENTIALS_FILE": "/nonexistent",
        "AWS_EC2_METADATA_DISABLED": "true",
    }.items():
        patch.setenv(name, value)
    patch.delenv("AWS_SESSION_TOKEN", raising=False)
    patch.delenv("AWS_PROFILE", raising=False)
    yield
    patch.undo()


@pytest.fixture(scope="session")
def moto(tmp_path_factory: pytest.TempPathFactory, aws_test_env: None) -> Iterator[MotoServer]:
    """moto's standalone server on 127.0.0.1, the credentials of ``aws_test_env`` in
    boto3's chain. Tests make their buckets with ``moto.ensure_bucket``."""
    server = MotoServer(tmp_path_factory.mktemp("moto") / "moto.log")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def juicefs(
    tmp_path_factory: pytest.TempPathFactory, aws_test_env: None
) -> Iterator[JuicefsGateway]:
    """The juicefs gateway on 127.0.0.1 (tests/s3server.py), its root user in boto3's
    chain: a second real S3 server, which checks signatures as MinIO does and ignores
    If-None-Match. Tests make their buckets with ``juicefs.ensure_bucket``."""
    server = JuicefsGateway(tmp_path_factory.mktemp("juicefs"))
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def proxy(moto: MotoServer) -> Iterator[CuttableProxy]:
    """A TCP forwarder to moto whose connections a test can cut."""
    forwarder = CuttableProxy(moto.port)
    yield forwarder
    forwarder.close()
