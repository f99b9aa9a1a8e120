"""Connectors by name: the registry, ``auto``, and a sender facing another connector."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from pdserve.core.errors import InvalidArgumentError, TransferError
from pdserve.transfer import connector_classes, resolve_connector, shm
from pdserve.transfer.shm import ShmReceiver, ShmSender


def test_connectors_are_chosen_by_name() -> None:
    for name in ("shm", "object_store", "p2p", "cuda_ipc"):
        sender_cls, receiver_cls = connector_classes(name)
        assert sender_cls.name == receiver_cls.name == name
    assert connector_classes("p2p")[1].needs_arrival_marks
    with pytest.raises(InvalidArgumentError, match="unknown connector 'carrier-pigeon'"):
        connector_classes("carrier-pigeon")


def test_auto_is_the_same_node_connector_for_where_the_cache_lives() -> None:
    assert resolve_connector("auto", "cpu") == "shm"
    assert resolve_connector("auto", "cuda") == "cuda_ipc"
    assert resolve_connector("p2p", "cuda") == "p2p"
    with pytest.raises(InvalidArgumentError, match="auto names no connector until a device"):
        connector_classes("auto")
    with pytest.raises(InvalidArgumentError, match="unknown connector 'nvlink'; known: auto,"):
        resolve_connector("nvlink", "cpu")


def test_a_sender_refuses_the_endpoint_of_another_connector(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(shm, "SHM_DIR", tmp_path)
    receiver = ShmReceiver("d0", 0)
    receiver.allocate((1, 2, 4, 4, 2, 8), torch.float32, torch.device("cpu"))
    endpoint = dataclasses.replace(receiver.endpoint(None), connector="cuda_ipc")
    with pytest.raises(TransferError, match="d0/0 takes pages over cuda_ipc, this prefill rank"):
        ShmSender().connect(endpoint)
    receiver.close()
