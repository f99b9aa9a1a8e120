"""The committed gRPC code matches the proto."""

from __future__ import annotations

from pdserve.router.frontdoor.proto import generate


def test_generated_code_is_current() -> None:
    assert generate.main(["--check"]) == 0, "run: python -m pdserve.router.frontdoor.proto.generate"


def test_check_notices_a_stale_file(tmp_path, monkeypatch) -> None:
    for name, text in generate.generate().items():
        (tmp_path / name).write_text(text)
    monkeypatch.setattr(generate, "OUT", tmp_path)
    assert generate.main(["--check"]) == 0
    stale = tmp_path / "completion_pb2.py"
    stale.write_text(stale.read_text() + "\n# edited by hand\n")
    assert generate.main(["--check"]) == 1
