from __future__ import annotations

import _posixsubprocess
import inspect
import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from jupyter_ext.core.criu import Criu
from jupyter_ext.core.errors import CriuNotFoundError
from testkit.processes import KernelProcess, MotoServer, free_port

from .support.s3server import JUICEFS_KEY, CuttableProxy, JuicefsGateway
from .support.servers import BUCKET, CREDENTIALS, HOST_ADDRESS, Network

#: Fixtures that start real processes (CRIU, kernels, servers, S3, pods, namespaces,
#: mounts), directly or through the fixtures they use: a test that uses one is ``system``.
SYSTEM_FIXTURES = frozenset(
    {
        "criu",
        "kernel_factory",
        "moto",
        "juicefs",
        "proxy",
        "network",
        "s3_url",
        "juicefs_url",
        "start_kernel",
        "live_server",
        "hub",
        "s3",
        "juicefs_s3",
        "server",
        "servers",
        "postgres",
        "http_server",
        "http4",
        "host_server",
        "make_pod",
        "agent",
        "pod_kernels",
        "strict_agent",
        "top",
        "lab",
        "s3_lab",
        "tmpfs",
        "small_disk",
        "small_work_disk",
        "memory_cgroup",
        "gpu_kernel",
        "plain_process",
        "built",
        "fake",
        "real_driver",
        "real_gpu_program",
        "overlay_dir",
        "printing",
        "libcuda",
        "running_extensions",
        "alice",
        "alice_snapshot",
    }
)
#: What in a test's code (its own and that of the helpers of tests/ it calls) starts a
#: process; the product's parts that do are named too.
SYSTEM_CODE = re.compile(
    r"\b(subprocess|Popen|KernelProcess|ServerProcess|MotoServer|create_subprocess_exec|"
    r"multiprocessing|os\.fork|ProcessPoolExecutor|sys\.executable|Supervisor|OwnNetwork)\b"
)
#: A parameter that starts an S3 server for the test (a store or backend on moto, juicefs).
SYSTEM_PARAMS = re.compile(r"(^|-)(s3|moto|juicefs)(-|$)")


def _code_reached(function: Any, depth: int = 3) -> str:
    """The source of ``function`` and of the functions and classes of tests/ and testkit/
    it names, to ``depth`` calls down."""
    sources, seen, todo = [], set(), [(function, 0)]
    while todo:
        obj, level = todo.pop()
        obj = inspect.unwrap(obj) if inspect.isfunction(obj) else obj
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        try:
            source = inspect.getsource(obj)
        except (OSError, TypeError):
            continue
        sources.append(source)
        if level == depth:
            continue
        names = getattr(obj, "__globals__", None) or vars(inspect.getmodule(obj) or object)
        for name in set(re.findall(r"\b[A-Za-z_]\w*\b", source)):
            found = names.get(name)
            if (inspect.isfunction(found) or inspect.isclass(found)) and str(
                getattr(found, "__module__", "")
            ).startswith(("tests", "testkit")):
                todo.append((found, level + 1))
    return "\n".join(sources)


def _starts_processes(item: pytest.Item) -> bool:
    if SYSTEM_FIXTURES & set(getattr(item, "fixturenames", ())):
        return True
    callspec = getattr(item, "callspec", None)
    if callspec is not None and SYSTEM_PARAMS.search(callspec.id):
        return True
    function = getattr(item, "function", None)
    if function is None:
        return True
    return SYSTEM_CODE.search(_code_reached(function)) is not None


#: Each system test file's seconds in a whole run, from its JUnit report
#: (scripts/system-seconds.py). The two workers of the system stage take the costliest
#: files first (``--dist loadfile --no-loadscope-reorder`` keeps this order): sent in order
#: of their number of tests, the one-test files (a 2-minute benchmark check) came last,
#: each running alone on one worker while the other had nothing left.
SYSTEM_SECONDS = Path(__file__).with_name("system-seconds.json")


def _costliest_files_first(items: list[pytest.Item]) -> None:
    """Sort the tests by their file's seconds (a file not measured last), a file's tests
    in their own order."""
    try:
        seconds: dict[str, float] = json.loads(SYSTEM_SECONDS.read_text())
    except (OSError, ValueError):
        return
    items.sort(key=lambda item: -seconds.get(item.path.name, 0.0))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that start real processes are marked ``system`` (``pytest -m "not system"``
    is the quick loop); on xdist's workers the costliest files come first; as an ordinary
    user, tests marked ``needs_root`` are skipped, saying why."""
    for item in items:
        if _starts_processes(item):
            item.add_marker(pytest.mark.system)
    if hasattr(config, "workerinput"):
        _costliest_files_first(items)
    if os.geteuid() == 0:
        return
    for item in items:
        marker = item.get_closest_marker("needs_root")
        if marker is not None:
            why = marker.args[0] if marker.args else "needs root"
            item.add_marker(pytest.mark.skip(reason=f"non-root run: {why} (docs/nonroot.md)"))


@pytest.fixture(autouse=True)
def _no_process_unless_system(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In the quick loop (``-m "not system"``), a test not marked ``system`` that starts a
    process fails, naming the fix: the marker stays true as tests change."""
    markexpr = request.config.getoption("markexpr", "") or ""
    if "not system" not in markexpr or request.node.get_closest_marker("system"):
        return

    def refuse(*args: Any, **kwargs: Any) -> Any:
        pytest.fail(
            "this test starts a process but is not marked 'system': add the fixture that "
            "starts it to SYSTEM_FIXTURES, or what calls it to SYSTEM_CODE (tests/conftest.py)"
        )

    monkeypatch.setattr(_posixsubprocess, "fork_exec", refuse)  # multiprocessing's spawn
    monkeypatch.setattr(subprocess, "_fork_exec", refuse)
    monkeypatch.setattr(subprocess, "_USE_POSIX_SPAWN", False)
    monkeypatch.setattr(os, "fork", refuse)


@pytest.fixture(autouse=True)
def _kernels_reaped(jp_server_cleanup: None, jp_asyncio_loop: Any) -> Iterator[None]:
    """Before pytest-jupyter's clean-up of an in-process server (which shuts its kernels
    down without reaping those slow to die): its kernels shut down and reaped."""
    yield
    from jupyter_server.serverapp import ServerApp

    from .support.jupyter_api import shut_down_kernels  # imported by the tests first

    if ServerApp.initialized():
        shut_down_kernels(ServerApp.instance(), jp_asyncio_loop)


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


pytest_plugins = ["pytest_jupyter.jupyter_server", "tests.support.jupyter_api"]


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
    """The juicefs gateway on 127.0.0.1 (tests/support/s3server.py), its root user in boto3's
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
    """A bridge to plug nodes into (tests/support/servers.py: Network, node_server)."""
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
