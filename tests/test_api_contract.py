"""The REST API keeps its written contract (jupyter_ext/openapi.yaml) whatever it is sent.

Bad input is a 4xx with the product's JSON error, never a 500: a deeply nested body, one
that is not JSON or not UTF-8, wrong types. schemathesis then sends generated requests,
valid and invalid, to a real ``jupyter server`` with a real snapshot kernel and a real
snapshot in its store, and checks every answer against the OpenAPI file: no server
error, a documented status code, content type and body.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast, get_args

import pytest
import schemathesis
import yaml
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)
from tornado import web

from jupyter_ext.core.protocol.progress import Phase
from jupyter_ext.handlers import route_table
from jupyter_ext.kernelspecs import KERNEL_NAME
from jupyter_ext.manager.jobs import JobKind
from testkit.processes import ServerProcess

from .support.jupyter_api import Fetch, server_config
from .support.servers import follow, ws_execute

OPENAPI = Path(__file__).parents[1] / "jupyter_ext" / "openapi.yaml"
SCHEMA = schemathesis.openapi.from_path(str(OPENAPI))
NO_KERNEL = "00000000-0000-0000-0000-000000000000"
NO_SNAPSHOT = "0" * 32
ERROR_FIELDS = {"message", "reason", "code", "hint", "log_excerpt"}


def nested(depth: int) -> bytes:
    """``{"a": {"a": ... 5}}``: valid JSON, deeper than Python's JSON decoder recurses."""
    return b'{"a": ' * depth + b"5" + b"}" * depth


@pytest.fixture
def jp_server_config(tmp_path: Path) -> dict[str, Any]:
    return server_config(tmp_path)


async def answer(jp_fetch: Fetch, method: str, path: str, body: bytes) -> tuple[int, Any]:
    """Status and JSON body of a raw request to /api/snapshots/<path>."""
    response = await jp_fetch(
        "api/snapshots" + path,
        method=method,
        body=body,
        headers={"Content-Type": "application/json"},
        raise_error=False,
    )
    assert response.headers["Content-Type"] == "application/json"
    return response.code, json.loads(response.body) if response.body else None


@pytest.mark.usefixtures("criu", "snapshot_kernelspec")
async def test_bad_bodies_are_400_with_the_cause_on_every_endpoint_that_reads_one(
    jp_fetch: Fetch, start_kernel: Any
) -> None:
    """A real kernel, so that the PATCH would otherwise succeed: only the body is wrong."""
    kernel = await start_kernel()
    endpoints = [
        ("POST", ""),
        ("POST", f"/{NO_SNAPSHOT}/restore"),
        ("PATCH", f"/kernels/{kernel.id}"),
    ]
    bodies = {
        nested(5000): "nested too deeply",
        b"[" * 100_000: "nested too deeply",
        b'{"kernel_id": ': "cannot be read as JSON",
        b'{"kernel_id": "\xff"}': "cannot be read as JSON",
        b'{"n": ' + b"9" * 5000 + b"}": "cannot be read as JSON",
        b"[1, 2]": "JSON object",
        b'"text"': "JSON object",
    }
    for method, path in endpoints:
        for body, cause in bodies.items():
            code, error = await answer(jp_fetch, method, path, body)
            assert code == 400, (method, path, body[:20], code, error)
            assert set(error) == ERROR_FIELDS, error
            assert cause in error["message"], error
            assert error["reason"] == error["code"] == "bad-request"
            assert error["hint"], error

    for method, path, body in [
        ("POST", "", {"kernel_id": 5}),
        ("POST", f"/{NO_SNAPSHOT}/restore", {"kernel_id": ["x"]}),
        ("POST", f"/{NO_SNAPSHOT}/restore", {"path": {"a": 1}}),
        ("PATCH", f"/kernels/{kernel.id}", {"periodic": "no"}),
    ]:
        code, error = await answer(jp_fetch, method, path, json.dumps(body).encode())
        assert code == 400, (method, path, body, code, error)
        assert error["code"] == "bad-request"
        assert error["hint"], error

    # What the endpoints do with good bodies is unchanged.
    code, status = await answer(jp_fetch, "PATCH", f"/kernels/{kernel.id}", b'{"periodic": false}')
    assert (code, status["periodic"]) == (200, False)
    code, error = await answer(jp_fetch, "POST", f"/{NO_SNAPSHOT}/restore", b"{}")
    assert (code, error["code"]) == (404, "snapshot-not-found")
    # suspend and resume read no body: a deep one is ignored, not a 500.
    for action in ("suspend", "resume"):
        code, error = await answer(jp_fetch, "POST", f"/kernels/{NO_KERNEL}/{action}", nested(5000))
        assert (code, error["code"]) == (404, "kernel-not-found")


async def test_bad_query_arguments_are_400_with_the_cause(
    http_server_client: Any, jp_base_url: str, jp_auth_header: dict[str, str]
) -> None:
    """Sent as they are (jp_fetch would quote them)."""
    for query, cause in [
        ("path=%ff", "Invalid unicode in path"),
        ("kernel_id=%c3%28", "Invalid unicode in kernel_id"),
        ("path=..%2Fsecret.ipynb", "not a notebook path"),
        ("trigger=sometimes", "trigger must be one of"),
    ]:
        response = await http_server_client.fetch(
            f"{jp_base_url}api/snapshots?{query}", headers=jp_auth_header, raise_error=False
        )
        assert response.code == 400, (query, response.code, response.body)
        error = json.loads(response.body)
        assert set(error) == ERROR_FIELDS, error
        assert cause in error["message"], error
        assert error["hint"], error


async def test_forbidden_is_json_in_the_documented_shape(jp_fetch: Fetch) -> None:
    for method, path, body in [
        ("GET", "", None),
        ("POST", "", nested(5000)),
        ("PATCH", f"/kernels/{NO_KERNEL}", b"{}"),
    ]:
        response = await jp_fetch(
            "api/snapshots" + path,
            method=method,
            body=body,
            headers={"Authorization": ""},
            raise_error=False,
        )
        assert response.code == 403
        assert response.headers["Content-Type"] == "application/json"
        error = json.loads(response.body)
        assert set(error) == ERROR_FIELDS, error
        assert error["code"] == error["reason"] == "forbidden"
        assert "token" in error["hint"]


# ---------------------------------------------------------------------- schemathesis


@pytest.fixture(scope="module")
def live_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """A real server with a snapshot kernel and one snapshot of it, so that listings and
    kernel statuses the checks see are real ones."""
    home = tmp_path_factory.mktemp("contract")
    (home / "notebooks").mkdir()
    server = ServerProcess(home / "server", home / "notebooks", server_config(home))
    try:
        kernel = server.api("POST", "api/kernels", {"name": "python3-snapshot"})
        ws_execute(server, kernel["id"], "state = 42")  # also waits for the kernel to be up
        follow(server, server.client.call("POST", "", body={"kernel_id": kernel["id"]})["job"])
        yield server
    finally:
        server.stop()


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]


@pytest.mark.usefixtures("criu")
@SCHEMA.parametrize()
@settings(
    max_examples=25,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
def test_api_keeps_its_openapi_contract(
    case: schemathesis.Case, live_server: ServerProcess
) -> None:
    # The token replaces whatever was generated for the security scheme's header (set on
    # the case itself, so that the checks judge the request that was really sent).
    case.headers = {**(case.headers or {}), "Authorization": f"token {live_server.token}"}
    case.call_and_validate(base_url=live_server.url + "api", checks=CHECKS, timeout=60)


def test_the_phases_are_one_list_everywhere() -> None:
    """The wrapper, the store and the manager report a job's phase as core.protocol's
    ``Phase``; the REST contract and the panel's types spell the same list, in order."""
    phases = list(get_args(Phase))
    spec = yaml.safe_load(OPENAPI.read_text())
    assert spec["components"]["schemas"]["Job"]["properties"]["phase"]["enum"] == phases
    tokens = (Path(__file__).parents[1] / "labextension" / "src" / "tokens.ts").read_text()
    union = re.search(r"export const PHASES = \[(.*?)\] as const;", tokens, re.S)
    assert union is not None
    assert re.findall(r"'([a-z-]+)'", union.group(1)) == phases


def test_the_job_kinds_are_one_list_everywhere() -> None:
    """The manager's ``JobKind``, the REST contract's ``Job.kind`` and the panel's
    ``JobKind`` are the same list."""
    kinds = list(get_args(JobKind))
    spec = yaml.safe_load(OPENAPI.read_text())
    assert spec["components"]["schemas"]["Job"]["properties"]["kind"]["enum"] == kinds
    tokens = (Path(__file__).parents[1] / "labextension" / "src" / "tokens.ts").read_text()
    union = re.search(r"export type JobKind =(.*?);", tokens, re.S)
    assert union is not None
    assert re.findall(r"'([a-z]+)'", union.group(1)) == kinds


def test_the_snapshot_kernel_is_named_once() -> None:
    """The kernel's name is kernelspecs.KERNEL_NAME in the Python packages (no other copy
    of it there) and the panel's SNAPSHOT_KERNEL_NAME is the same."""
    root = Path(__file__).parents[1]
    copies = [
        str(path.relative_to(root))
        for package in ("jupyter_ext", "kernel_wrapper")
        for path in sorted((root / package).rglob("*.py"))
        if KERNEL_NAME in path.read_text()
    ]
    assert copies == ["jupyter_ext/kernelspecs.py"]
    tokens = (root / "labextension" / "src" / "tokens.ts").read_text()
    panel = re.search(r"export const SNAPSHOT_KERNEL_NAME = '([^']+)';", tokens)
    assert panel is not None
    assert panel.group(1) == KERNEL_NAME


def test_openapi_documents_exactly_the_routes() -> None:
    """Every documented path and method reaches a handler that implements it (the first
    route that matches, as tornado picks), and every method of every route is documented."""
    spec = yaml.safe_load(OPENAPI.read_text())
    base = spec["servers"][0]["url"]
    routes = route_table(cast(Any, None), {})
    examples = {"kernel_id": NO_KERNEL, "job_id": "0" * 16, "snapshot_id": NO_SNAPSHOT}

    def implemented(handler: type[web.RequestHandler]) -> set[str]:
        return {
            method
            for method in ("get", "post", "put", "patch", "delete")
            if getattr(handler, method) is not getattr(web.RequestHandler, method)
        }

    documented: dict[type[web.RequestHandler], set[str]] = {}
    for path, operations in spec["paths"].items():
        url = base + re.sub(r"\{(\w+)\}", lambda m: examples[m.group(1)], path)
        handler = next((h for pattern, h, _ in routes if re.fullmatch(pattern, url)), None)
        assert handler is not None, f"{path} is documented but no route serves it"
        methods = set(operations) - {"parameters"}
        assert methods <= implemented(handler), (path, methods, handler.__name__)
        documented.setdefault(handler, set()).update(methods)
    for pattern, handler, _ in routes:
        assert implemented(handler) == documented.get(handler, set()), (pattern, handler)
