"""A real S3 endpoint for the tests: moto's standalone server (as s3fs's own tests use) on 127.0.0.1, started by
the test session and stopped at its end, and test-side access to it through boto3 (not through fsspec/s3fs, the
libraries under test).

The tools find the endpoint and the credentials where every S3 client looks: ``AWS_ENDPOINT_URL`` and the
``AWS_*`` variables of the environment, which subprocesses and Ray workers inherit.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

HOST = "127.0.0.1"  # never another address: the server is for this machine's tests only
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "mtnlg-test-key",
    "AWS_SECRET_ACCESS_KEY": "mtnlg-test-secret",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class ObjectStore:
    """A running S3 server: its endpoint, the environment that points clients at it, and boto3 helpers."""

    def __init__(self, endpoint: str):
        self.endpoint = endpoint
        self.env = {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}
        import boto3

        self.client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
        )

    def new_bucket(self, prefix: str = "t") -> str:
        """A fresh, empty bucket; its name."""
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        self.client.create_bucket(Bucket=name)
        return name

    def put(self, url: str, data: bytes, public: bool = False) -> None:
        """An object; ``public``: readable by anyone over plain HTTP(S) (ACL public-read), as a published corpus."""
        bucket, key = split(url)
        self.client.put_object(Bucket=bucket, Key=key, Body=data, **({"ACL": "public-read"} if public else {}))

    def get(self, url: str) -> bytes:
        bucket, key = split(url)
        return self.client.get_object(Bucket=bucket, Key=key)["Body"].read()

    def keys(self, url: str) -> list[str]:
        """Every key below the prefix ``url``, relative to it, sorted (hidden ones too)."""
        bucket, prefix = split(url)
        prefix = prefix.rstrip("/") + "/" if prefix else ""
        found = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            found += [o["Key"][len(prefix) :] for o in page.get("Contents", [])]
        return sorted(found)

    def put_tree(self, local: Path, url: str) -> None:
        """Every file below ``local`` to the same relative keys below ``url``."""
        for path in sorted(Path(local).rglob("*")):
            if path.is_file():
                self.put(f"{url.rstrip('/')}/{path.relative_to(local).as_posix()}", path.read_bytes())

    def tree(self, url: str) -> dict[str, bytes]:
        """{relative key: bytes} below ``url`` (hidden keys too: a test sees what a careless reader would)."""
        return {k: self.get(f"{url.rstrip('/')}/{k}") for k in self.keys(url)}


def split(url: str) -> tuple[str, str]:
    bucket, _, key = url.removeprefix("s3://").partition("/")
    return bucket, key


def local_tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(Path(root).rglob("*")) if p.is_file()}


@contextmanager
def moto_server():
    """moto's threaded server on 127.0.0.1 (a free port), this process's environment pointed at it meanwhile."""
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise
    server = ThreadedMotoServer(ip_address=HOST, port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    store = ObjectStore(f"http://{host}:{port}")
    saved = {k: os.environ.get(k) for k in store.env}
    os.environ.update(store.env)
    try:
        yield store
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


@contextmanager
def refusing_server():
    """A second moto server that checks credentials (``INITIAL_NO_AUTH_ACTION_COUNT=0``): it refuses every key
    it has not issued, as S3 refuses a wrong one. A subprocess (the setting is read when moto starts), bounded by
    a timeout and stopped at the end."""
    import socket

    with socket.socket() as s:
        s.bind((HOST, 0))
        port = s.getsockname()[1]
    env = {**os.environ, "INITIAL_NO_AUTH_ACTION_COUNT": "0"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", HOST, "-p", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://{HOST}:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with socket.create_connection((HOST, port), timeout=1):
                    break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError("the credential-checking moto server did not start") from None
                time.sleep(0.1)
        yield endpoint
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
