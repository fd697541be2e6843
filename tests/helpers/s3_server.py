"""A real S3 endpoint on localhost: moto's server mode, spoken to over HTTP by s3fs and boto3 as
any S3-compatible store would be. Credentials and the endpoint reach the clients only through
the standard AWS variables, as in production.

Use: ``from helpers.s3_server import s3_bucket_fixture, s3_server_fixture  # noqa: F401``: the
fixtures ``s3_server`` and ``s3_bucket`` (imported under these names, so that a test's parameter
of the fixture's name shadows nothing).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ACCESS_KEY = "AKIALINNAEUSTESTKEY01"
SECRET_KEY = "linnaeus-test-secret-do-not-print-0123456789"


@pytest.fixture(scope="module", name="s3_server")
def s3_server_fixture() -> Iterator[str]:
    """The endpoint URL of a moto S3 server on a free port (one per test module)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


def use_endpoint(monkeypatch: pytest.MonkeyPatch, endpoint: str, tmp_path: Path) -> None:
    """The AWS chain points at ``endpoint`` with the test keys; a developer's ~/.aws is not read."""
    for name, value in {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials"),
        # botocore retries a refused connection 4 times with backoff (~7 s); one try shows the same.
        "AWS_MAX_ATTEMPTS": "1",
    }.items():
        monkeypatch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3"):
        monkeypatch.delenv(name, raising=False)


def s3_client() -> Any:
    """A boto3 client from the same environment: a second opinion on what the bucket holds."""
    import boto3

    return boto3.client("s3")


@pytest.fixture(name="s3_bucket")
def s3_bucket_fixture(s3_server: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """A new, empty bucket on the server, and the AWS variables pointing at it; its name."""
    use_endpoint(monkeypatch, s3_server, tmp_path)
    name = f"ckpt-{uuid.uuid4().hex[:12]}"
    s3_client().create_bucket(Bucket=name)
    return name


def object_keys(bucket: str) -> list[str]:
    """Every key in the bucket, by boto3 (not by the code under test)."""
    pages = s3_client().get_paginator("list_objects_v2").paginate(Bucket=bucket)
    return sorted(item["Key"] for page in pages for item in page.get("Contents", []))


class LoggedS3Server:
    """moto's S3 server, as ``s3_server`` starts it, that also keeps the request log a store's
    operator would read: (method, key, query, status) of every request, in the order the server
    answered them (by then the request's effect is in the bucket). ``key`` is ``bucket/key``."""

    def __init__(self) -> None:
        from moto.server import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
        from werkzeug.serving import make_server

        self.log: list[tuple[str, str, str, int]] = []
        self._lock = threading.Lock()
        app = DomainDispatcherApplication(create_backend_app)

        def logged(environ: dict[str, Any], start_response: Any) -> Any:
            def start(status: str, headers: Any, *args: Any) -> Any:
                key = environ.get("PATH_INFO", "").lstrip("/")
                with self._lock:
                    self.log.append(
                        (
                            environ["REQUEST_METHOD"],
                            key,
                            environ.get("QUERY_STRING", ""),
                            int(status.split()[0]),
                        )
                    )
                return start_response(status, headers, *args)

            return app(environ, start)

        class Quiet(MotoRequestHandler):  # type: ignore[misc]
            def log(self, *args: Any) -> None:  # the log above is the one the tests read
                pass

        self._server = make_server("127.0.0.1", 0, logged, True, request_handler=Quiet)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        host, port = self._server.server_address[:2]
        self.address = (str(host), int(port))
        self.url = f"http://{host}:{port}"

    def requests(self) -> list[tuple[str, str, str, int]]:
        with self._lock:
            return list(self.log)

    def stop(self) -> None:
        self._server.shutdown()
        self._thread.join()


def direct_client(endpoint: str) -> Any:
    """A boto3 client of the server itself, past any faulty link the code under test goes through."""
    import boto3

    return boto3.client("s3", endpoint_url=endpoint)
