"""Plain HTTP calls to a front door, for tests that send bytes no client library would.

Each returns the status and the body whatever the status is (an HTTP error is an
answer here, not an exception), with the test key of :mod:`tests.e2e.test_router`.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request

from tests.e2e.tiny_cluster import KEY


def raw_post(doors, path: str, data: bytes, key: str = KEY) -> tuple[int, dict]:
    """POST ``data`` as JSON; the status and the JSON body."""
    status, body = raw_post_any(doors, path, data, key, timeout=30)
    return status, json.loads(body)


def raw_post_any(
    doors, path: str, data: bytes, key: str = KEY, timeout: float = 60
) -> tuple[int, bytes]:
    """Like raw_post, for any answer (a 200 may be a stream)."""
    req = urllib.request.Request(
        f"http://{doors.host}:{doors.http_port}{path}", data=data, method="POST"
    )
    req.add_header("Content-Type", "application/json")
    req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def get(doors, path: str) -> tuple[int, str]:
    url = f"http://{doors.host}:{doors.http_port}{path}"
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
