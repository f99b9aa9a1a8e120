"""Ray addresses the cluster commands dial: the forms Ray takes, and the rest refused
with the flag named before Ray sees them."""

from __future__ import annotations

import pytest

from pdserve.cluster.connect import check_ray_address, is_host_port
from pdserve.core.errors import InvalidArgumentError


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
