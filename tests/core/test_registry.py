"""The model registry: immutable versions, checked against their hashes when resolved."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from pdserve import LLM, SamplingParams
from pdserve.core import registry
from pdserve.core.errors import InvalidArgumentError, ModelNotFoundError
from pdserve.deploy.cli import main
from pdserve.models.builtin import resolve_model


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


def test_a_broken_manifest_is_named_never_taken_for_a_version(
    root: Path, tiny_path: Path, capsys
) -> None:  # type: ignore[no-untyped-def]
    # edited by hand or cut short: resolving, verifying and listing name the file; the
    # other versions still list
    registry.push("tiny", "v1", tiny_path)
    registry.push("tiny", "v2", tiny_path)
    manifest = root / "tiny" / "v2" / registry.MANIFEST
    good = manifest.read_text()
    for text, why in (
        (good[: len(good) // 2], "is not a manifest: "),
        ("[1, 2]", "not a JSON object"),
        (good.replace('"sha256"', '"sha"', 1), "'sha256' missing or not a str"),
        (
            good.replace('"version": "v2"', '"version": "v1"'),
            "names tiny@v1, not the folder's tiny@v2",
        ),
        (
            good.replace('"config.json"', '"../../x.json"'),
            "a file outside its folder: ../../x.json",
        ),
    ):
        manifest.write_text(text)
        with pytest.raises(InvalidArgumentError, match=why.replace("(", r"\(")):
            resolve_model("registry:tiny@v2")
        assert main(["registry", "verify", "tiny@v2"]) == 2
        assert why in capsys.readouterr().err
        assert main(["registry", "list"]) == 1
        out, err = capsys.readouterr()
        assert "tiny@v1" in out and "tiny@v2" not in out
        assert str(manifest) in err and "Traceback" not in err


def _tamper_keeping_stats(path: Path) -> None:
    """One byte of ``path`` changed, its size and modification time as they were."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (path.stat().st_size, path.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)


def test_a_file_changed_with_its_size_and_mtime_restored_is_refused(
    root: Path, tiny_path: Path
) -> None:
    # Resolved once in this process (a controller starting instances), then changed:
    # the next resolve hashes the bytes again, it does not trust the file's stats.
    registry.push("tiny", "v1", tiny_path)
    folder = resolve_model("registry:tiny@v1")
    _tamper_keeping_stats(folder / "model.safetensors")
    with pytest.raises(InvalidArgumentError, match=r"model\.safetensors does not match its hash"):
        resolve_model("registry:tiny@v1")
