"""The hub service: signs each user server's S3 requests for that user's prefix only, and
hands each user's server that user's key-encryption key.

It runs as a JupyterHub managed service (``c.JupyterHub.services``; the hub starts it
with ``JUPYTERHUB_API_TOKEN``, ``JUPYTERHUB_API_URL``, ``JUPYTERHUB_SERVICE_NAME`` and
``JUPYTERHUB_SERVICE_URL``). A caller is whoever the hub says its token belongs to
(``/hub/api/user``, cached 60 s): a user whose token carries
``access:services!service=<name>``, which the hub's ``server`` role gives every
single-user server's own token. The user comes from the hub's answer, never from the
request. The bucket's credentials stay in this process (boto3's chain: its environment,
files, or the pod's identity); the key secrets in the file ``--key-secrets-file``: one
secret a line (hex, 32 bytes or more, ``openssl rand -hex 32``), the current one first,
older ones after it, still handed out to unwrap until everything is rewrapped.

Endpoints, under the service's prefix (``/services/<name>/``):

- ``POST sign``: ``{"method", "url", "headers", "payload_sha256"}`` ->
  ``{"headers": {...}}`` to add to that request (with the guards of a lax S3 server for a
  PUT); 403 with the reason if it leaves the caller's prefix.
- ``GET key``: ``{"current": {"id", "key"}, "previous": [{"id", "key"}, ...]}``, keys in
  base64: the caller's own key-encryption key.

At start it probes the bucket's S3 server (core/store/probe.py, in ``<prefix>/.probe/``)
and logs plainly what it checks and whether it can keep the users apart; where the server
acts on unsigned ``x-amz-*`` headers, every PUT it signs carries the guards
(``scope.LAX_SERVER_GUARDS``). A probe that could not reach the server is tried again at
the next signing, at most once a minute.
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from tornado import web
from tornado.ioloop import IOLoop

from ..core.store.api import StoreError
from ..core.store.probe import ServerChecks, Signer, probe_server
from ..core.store.scope import LAX_SERVER_GUARDS, SignRequest, UserScope, sign
from ..core.store.userkey import derive_user_key, parse_secret

TOKEN_CACHE_SECONDS = 60
PROBE_RETRY_SECONDS = 60
log = logging.getLogger("jupyter_ext.hubservice")


class Service:
    """What the handlers share: the hub's auth, the bucket's settings and credentials, the
    key secrets."""

    def __init__(self, options: argparse.Namespace) -> None:
        import boto3
        from jupyterhub.services.auth import HubAuth

        self.auth = HubAuth(cache_max_age=TOKEN_CACHE_SECONDS)
        self.bucket: str = options.bucket
        self.base: str = options.prefix
        self.endpoint_url: str = options.endpoint_url
        self.region: str = options.region
        self.session = boto3.session.Session(region_name=self.region)
        if self.session.get_credentials() is None:
            raise StoreError(
                "The hub service found no credentials for the bucket.",
                hint="Give the service credentials through boto3's chain (its environment: "
                "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a file, or the pod's identity).",
            )
        self.secrets: list[bytes] = []
        if options.key_secrets_file:
            self.secrets = read_secrets(Path(options.key_secrets_file))
        self.checks: ServerChecks | None = None
        """What the bucket's server checks (None: not probed yet, or it did not answer)."""
        self._probed_at = -float("inf")
        self._probe_lock = threading.Lock()

    def scope(self, user: str) -> UserScope:
        return UserScope(self.bucket, self.base, user, self.endpoint_url, self.region)

    def credentials(self) -> Any:
        """The bucket's credentials now (refreshed by botocore if they are temporary)."""
        return self.session.get_credentials().get_frozen_credentials()

    def probe(self) -> None:
        """Probe the bucket's server (unless done, or tried within PROBE_RETRY_SECONDS) and
        log plainly what it found: an error where the store cannot keep users apart."""
        with self._probe_lock:
            if self.checks is not None or time.monotonic() - self._probed_at < PROBE_RETRY_SECONDS:
                return
            self._probed_at = time.monotonic()
            signer = Signer(self.credentials(), self.region)
            try:
                checks = probe_server(
                    self.endpoint_url, self.region, self.bucket, self.base, signer
                )
            except StoreError as exc:
                log.warning("Could not probe the bucket's S3 server (tried again later): %s", exc)
                return
            self.checks = checks
        log.info("The bucket's S3 server %s", "; ".join(checks.findings()))
        if not checks.keeps_users_apart:
            log.error("%s", checks.verdict())
        elif checks.lax:
            log.warning("%s", checks.verdict())
        else:
            log.info("%s", checks.verdict())

    def guards(self, request: SignRequest) -> dict[str, str]:
        """What the service signs into ``request`` besides what was asked: the guards,
        into a PUT, where the server acts on unsigned x-amz-* headers."""
        lax = self.checks is not None and self.checks.lax
        return dict(LAX_SERVER_GUARDS) if lax and request.method == "PUT" else {}


class _Handler(web.RequestHandler):
    def initialize(self, service: Service) -> None:
        self.service = service

    def check_xsrf_cookie(self) -> None:
        """Callers authenticate with a token header, never a cookie: no XSRF to check."""

    async def caller(self) -> str:
        """The user whose token this is, if it may use this service; else 403."""
        auth = self.service.auth
        token = auth.get_token(self, in_cookie=False)
        model = await auth.user_for_token(token, sync=False) if token else None
        if not model or model.get("kind") != "user":
            raise web.HTTPError(403, "A user server's hub token is required.")
        if not auth.check_scopes(auth.access_scopes, model):
            raise web.HTTPError(403, f"This token lacks {sorted(auth.access_scopes)[0]}.")
        name: str = model["name"]
        return name

    def answer(self, body: dict[str, Any]) -> None:
        self.set_header("Content-Type", "application/json")
        self.set_header("Cache-Control", "no-store")
        self.finish(json.dumps(body))

    def write_error(self, status_code: int, **kwargs: Any) -> None:
        exc = kwargs.get("exc_info", (None, None))[1]
        message = self._reason
        if isinstance(exc, web.HTTPError) and exc.log_message:
            # tornado doubles each % of a message given without arguments
            message = exc.log_message % exc.args
        self.set_header("Content-Type", "application/json")
        self.finish(json.dumps({"message": message or self._reason}))


class SignHandler(_Handler):
    async def post(self) -> None:
        user = await self.caller()
        try:
            data = json.loads(self.request.body)
            request = SignRequest.from_dict(data)
            scope = self.service.scope(user)
            scope.check(request)
        except (ValueError, AttributeError) as exc:
            raise web.HTTPError(400, f"A malformed signing request: {exc}") from exc
        except StoreError as exc:
            log.warning("refused for %s: %s", user, exc.message)
            raise web.HTTPError(403, str(exc)) from exc
        if self.service.checks is None:
            await IOLoop.current().run_in_executor(None, self.service.probe)
        extra = self.service.guards(request)
        credentials = self.service.credentials()
        self.answer({"headers": sign(request, credentials, scope.region, extra=extra)})


class KeyHandler(_Handler):
    async def get(self) -> None:
        user = await self.caller()
        if not self.service.secrets:
            raise web.HTTPError(
                503, "The hub service has no key secret: its admin sets --key-secrets-file."
            )
        self.answer(key_answer(self.service.secrets, user))


def key_answer(secrets: list[bytes], user: str) -> dict[str, Any]:
    """``GET key``'s answer: the user's key under each secret, the first one's as current
    (read by :class:`~jupyter_ext.core.store.hubclient.HubKeySource`)."""
    keys = [derive_user_key(secret, user) for secret in secrets]
    encoded = [{"id": kid, "key": base64.b64encode(key).decode()} for kid, key in keys]
    return {"current": encoded[0], "previous": encoded[1:]}


def read_secrets(path: Path) -> list[bytes]:
    """The key secrets of ``path``, current first; read once, at start (a rotation:
    put the new secret on the first line, restart the service)."""
    try:
        lines = path.read_text().split()
    except OSError as exc:
        raise StoreError(
            f"Cannot read the key secrets file {path}: {exc.strerror}.",
            hint="Mount the Secret that holds it there (deploy/z2jh/config.yaml), or correct "
            "--key-secrets-file.",
        ) from exc
    if not lines:
        raise StoreError(
            f"The key secrets file {path} is empty.",
            hint="Put a secret in it: `openssl rand -hex 32`.",
        )
    return [parse_secret(line, f"a line of {path}") for line in lines]


def make_app(service: Service, prefix: str) -> web.Application:
    prefix = "/" + prefix.strip("/") + "/" if prefix.strip("/") else "/"
    routes: list[Any] = [
        (prefix + "sign", SignHandler, {"service": service}),
        (prefix + "key", KeyHandler, {"service": service}),
    ]
    return web.Application(routes)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m jupyter_ext.hubservice",
        description=__doc__.split("\n\n")[0] if __doc__ else None,
    )
    parser.add_argument("--bucket", required=True, help="The store's bucket (s3_bucket).")
    parser.add_argument(
        "--prefix",
        default="kernel-snapshots",
        help="The store's key prefix (s3_prefix); user U's part is <prefix>/users/U/. "
        "Default: kernel-snapshots.",
    )
    parser.add_argument(
        "--endpoint-url",
        default="",
        help="The S3-compatible endpoint (s3_endpoint_url). Default: AWS S3.",
    )
    parser.add_argument("--region", default="us-east-1", help="Default: us-east-1.")
    parser.add_argument(
        "--ip",
        default="",
        help="Address to listen on. Default: the host of $JUPYTERHUB_SERVICE_URL "
        "(0.0.0.0 where user servers reach it through a Kubernetes Service).",
    )
    parser.add_argument(
        "--key-secrets-file",
        default="",
        help="A file of key secrets (hex, one a line, the current first) from which each "
        "user's key-encryption key is derived. Default: none (no keys handed out).",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="[%(name)s %(levelname)s] %(message)s")
    options = parse_args(argv)
    url = urlsplit(os.environ.get("JUPYTERHUB_SERVICE_URL", ""))
    if not url.port:
        raise SystemExit("JUPYTERHUB_SERVICE_URL with a port is required (set by the hub).")
    service = Service(options)
    service.probe()
    app = make_app(service, os.environ.get("JUPYTERHUB_SERVICE_PREFIX", "/"))
    app.listen(url.port, options.ip or url.hostname or "127.0.0.1")
    log.info("signing for s3://%s/%s/users/<user>/ on %s", service.bucket, service.base, url.port)
    try:
        IOLoop.current().start()
    except KeyboardInterrupt:  # the hub stops its managed services with SIGINT
        log.info("stopped")
