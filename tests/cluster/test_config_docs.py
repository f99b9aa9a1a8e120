"""docs/config.md is the configuration reference rendered from the config dataclasses
(pdserve.deploy.config_docs): it must be current, describe every key, and name every
key the YAML reader takes. No Ray."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from pdserve.cluster.config import parse_config
from pdserve.core.errors import InvalidArgumentError
from pdserve.deploy import config_docs

PAGE = Path(__file__).resolve().parents[2] / "docs" / "config.md"
CLUSTER = "model: builtin:tiny\nregions:\n  - name: east\n"


def known_keys(text: str) -> set[str]:
    """The keys the reader lists when ``text`` has an unknown one."""
    with pytest.raises(InvalidArgumentError) as e:
        parse_config(text)
    found = re.search(r"unknown field \(known: (\[.*?\])\)", str(e.value))
    assert found, str(e.value)
    return set(ast.literal_eval(found.group(1)))


def documented(path: str) -> set[str]:
    return {key.name for s in config_docs.sections() if s.path == path for key in s.keys}


def test_the_page_is_current() -> None:
    assert PAGE.read_text() == config_docs.render(), (
        "docs/config.md is stale: run `make config-docs` and commit the page"
    )


def test_every_key_has_a_description() -> None:
    missing = list(config_docs.undocumented())
    assert not missing, (
        "give these fields a `name: text` line in their dataclass's Attributes block:\n"
        + "\n".join(missing)
    )


def test_the_page_names_every_top_level_key_the_reader_takes() -> None:
    sections = {re.split(r"[.:\[]", s.path)[0] for s in config_docs.sections()}
    assert known_keys(CLUSTER + "bogus: 1\n") == documented("top level") | sections - {"top level"}


def test_the_page_names_every_key_of_every_section() -> None:
    region = known_keys("model: builtin:tiny\nregions:\n  - {name: east, bogus: 1}\n")
    assert documented("regions[]") == region
    for path, keys in config_docs.keys_read().items():
        assert documented(path) == keys, path
    assert documented("rollout") == known_keys(CLUSTER + "rollout: {bogus: 1}\n")
    for section in ("planner", "health", "disaggregation"):
        assert documented(section) == known_keys(CLUSTER + f"{section}: {{bogus: 1}}\n")
    assert documented("ray") == known_keys(CLUSTER + "ray: {bogus: 1}\n")


def test_attribute_blocks_are_read_with_continuations_and_shared_entries() -> None:
    class Example:
        """One line.

        Attributes:
            a, b: shared
                over two lines.
            c: alone.

        Not an attribute: here.
        """

    assert config_docs.attribute_docs(Example) == {
        "a": "shared over two lines.",
        "b": "shared over two lines.",
        "c": "alone.",
    }
