"""The model registry: immutable versions, checked against their hashes when resolved."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from pdserve import LLM, SamplingParams
from pdserve.core import registry
from pdserve.core.builtin_models import resolve_model
from pdserve.core.errors import InvalidArgumentError, ModelNotFoundError
from pdserve.deploy.cli import main


@pytest.fixture
def root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PDSERVE_REGISTRY", str(tmp_path / "registry"))
    return tmp_path / "registry"


def test_a_pushed_version_serves_like_its_source(root: Path, tiny_path: Path, capsys) -> None:
    assert main(["registry", "push", "tiny", "v1", str(tiny_path)]) == 0
    assert "serve it as model: registry:tiny@v1" in capsys.readouterr().out
    folder = resolve_model("registry:tiny@v1")
    assert folder == root / "tiny" / "v1"
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = LLM(str(tiny_path)).generate([[5, 6, 7, 8]], params)[0].outputs[0].token_ids
    got = LLM("registry:tiny@v1").generate([[5, 6, 7, 8]], params)[0].outputs[0].token_ids
    assert got == want
    assert main(["registry", "list"]) == 0
    assert "tiny@v1" in capsys.readouterr().out


def test_versions_are_immutable_and_checked(root: Path, tiny_path: Path) -> None:
    manifest = registry.push("tiny", "v1", tiny_path)
    assert len(manifest["sha256"]) == 64 and "model.safetensors" in manifest["files"]
    with pytest.raises(InvalidArgumentError, match="immutable"):
        registry.push("tiny", "v1", tiny_path)
    weights = root / "tiny" / "v1" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(InvalidArgumentError, match=r"tiny@v1: model\.safetensors does not match"):
        resolve_model("registry:tiny@v1")
    assert main(["registry", "verify", "tiny@v1"]) == 2
    registry.push("tiny", "v2", tiny_path)
    (root / "tiny" / "v2" / "extra.bin").write_bytes(b"x")
    with pytest.raises(InvalidArgumentError, match=r"extra\.bin was added"):
        resolve_model("registry:tiny@v2")
    shutil.rmtree(root / "tiny" / "v2")
    with pytest.raises(ModelNotFoundError, match=r"tiny@v3 is not in the registry.*\['v1'\]"):
        resolve_model("registry:tiny@v3")


@pytest.mark.parametrize(
    "ref", ["registry:tiny", "registry:@v1", "registry:../x@v1", "registry:a@b/c"]
)
def test_a_malformed_reference_names_the_field(root: Path, ref: str) -> None:
    with pytest.raises(InvalidArgumentError, match=r"registry:<name>@<version>"):
        resolve_model(ref)
