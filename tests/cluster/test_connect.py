"""Ray addresses the cluster commands dial: the forms Ray takes, and the rest refused
with the flag named before Ray sees them; the local cluster "auto" finds."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.cluster.connect import (
    EMBEDDED,
    RAY_STARTED,
    check_ray_address,
    connect,
    found_address,
    is_host_port,
    ray_temp_dir,
)
from pdserve.core.errors import InstanceFailedError, InvalidArgumentError


@pytest.mark.parametrize(
    "address", ["auto", "local", "10.0.0.1:6379", "head-node:6379", "[::1]:6379", "ray://h:10001"]
)
def test_the_forms_ray_dials_pass(address: str) -> None:
    check_ray_address(address)


@pytest.mark.parametrize(
    ("address", "says"),
    [
        ("http://127.0.0.1:8265", "is an HTTP address (a Ray dashboard's?)"),
        ("https://head:8265", "is an HTTP address"),
        ("ftp://head:21", "the only scheme Ray dials is ray://"),
        ("head", "is not HOST:PORT"),
        ("head:", "is not HOST:PORT"),
        (":6379", "is not HOST:PORT"),
        ("head:port", "is not HOST:PORT"),
        ("head:0", "is not HOST:PORT"),
        ("head:65536", "is not HOST:PORT"),
        ("ray://head", "is not HOST:PORT"),
        ("", "is not HOST:PORT"),
    ],
)
def test_other_addresses_are_refused_naming_where_they_came_from(address: str, says: str) -> None:
    with pytest.raises(InvalidArgumentError, match="RAY_ADDRESS") as e:
        check_ray_address(address, "RAY_ADDRESS")
    assert e.value.field == "RAY_ADDRESS" and says in e.value.message


def test_host_port() -> None:
    assert is_host_port("h:1") and is_host_port("h:65535")
    assert not any(map(is_host_port, ["h", "h:-1", "h:1.5", "1", "h:1:"]))


@pytest.fixture
def ray_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    (tmp_path / "ray").mkdir()
    assert ray_temp_dir() == tmp_path / "ray"
    return tmp_path / "ray"


def test_auto_finds_what_ray_start_or_an_embedded_serve_announced_and_listens(ray_tmp) -> None:
    with socket.socket() as ray_started, socket.socket() as embedded:
        for s in (ray_started, embedded):
            s.bind(("127.0.0.1", 0))
            s.listen()
        at = [f"127.0.0.1:{s.getsockname()[1]}" for s in (ray_started, embedded)]
        assert found_address() is None
        (ray_tmp / EMBEDDED).write_text(at[1])
        assert found_address() == at[1]
        (ray_tmp / RAY_STARTED).write_text(at[0] + "\n")
        assert found_address() == at[0]  # `ray start`'s first, as Ray's own "auto"
        ray_started.close()  # a cluster that is gone: its file is stale
        assert found_address() == at[1]
    assert found_address() is None  # both gone


def test_auto_with_nothing_announced_is_refused_not_joined_or_started(ray_tmp) -> None:
    (ray_tmp / EMBEDDED).write_text("not an address")
    with pytest.raises(InstanceFailedError, match="no Ray cluster on this machine"):
        connect("auto", start_local=False)


def test_an_embedded_ray_withdraws_its_address_at_exit_unless_another_took_it(ray_tmp) -> None:
    def run(code: str) -> None:
        announce = "from pdserve.cluster.connect import announce, ray_temp_dir\n"
        subprocess.run([sys.executable, "-c", announce + code], check=True, timeout=60)

    run("announce('127.0.0.1:1')\nassert (ray_temp_dir() / 'pdserve_current_cluster').is_file()")
    assert not (ray_tmp / EMBEDDED).exists()
    run("announce('127.0.0.1:1')\n(ray_temp_dir() / 'pdserve_current_cluster').write_text('h:2')")
    assert (ray_tmp / EMBEDDED).read_text() == "h:2"
