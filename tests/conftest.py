from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from jupyter_ext.core.criu import Criu
from jupyter_ext.core.errors import CriuNotFoundError
from jupyter_ext.testing import KernelProcess, MotoServer, free_port

from .s3server import JUICEFS_KEY, CuttableProxy, JuicefsGateway
from .servers import BUCKET, CREDENTIALS, HOST_ADDRESS, Network


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


@pytest.fixture(scope="module")
def network() -> Iterator[Network]:
    """A bridge to plug nodes into (tests/servers.py: Network, node_server)."""
    net = Network()
    yield net
    net.close()


@pytest.fixture(scope="module")
def juicefs_url(network: Network, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The juicefs gateway on the bridge: a second real S3 server for the nodes (it
    ignores If-None-Match; its stores create records and keys under lock objects)."""
    server = JuicefsGateway(tmp_path_factory.mktemp("juicefs"), host=HOST_ADDRESS)
    server.ensure_bucket(BUCKET)
    yield server.url
    server.stop()


@pytest.fixture(scope="module")
def s3_url(network: Network, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """moto's standalone server on the bridge, reachable from every node."""
    import boto3

    port = free_port()
    log = (tmp_path_factory.mktemp("moto") / "moto.log").open("wb")
    server = subprocess.Popen(
        [str(Path(sys.executable).with_name("moto_server")), "-H", HOST_ADDRESS, "-p", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://{HOST_ADDRESS}:{port}"
    client = boto3.client("s3", endpoint_url=url, **CREDENTIALS)
    deadline = time.monotonic() + 30
    while True:
        try:
            client.create_bucket(Bucket=BUCKET)
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    yield url
    server.terminate()
    server.wait(10)
    log.close()
