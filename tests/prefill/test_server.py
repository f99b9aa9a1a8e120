"""The prefill role around a real one-rank engine, its decode peer a fake actor (no Ray).

Each test builds a :class:`PrefillServer` on the tiny model and checks what it
promises: the first token comes back at once, the pages of a reserved request
are streamed page by page (a page that was partly filled is sent again), the
hand-off names the decode instance's pages, pages are held until the decode
instance answers, and every way a request can end frees them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import Future
from pathlib import Path

import pytest
from ray.exceptions import RayActorError

from pdserve.core.errors import (
    InstanceFailedError,
    InvalidArgumentError,
    RequestAbortedError,
    RequestFailedError,
    TransferError,
)
from pdserve.core.messages import FirstToken, PrefillRequest, Reservation
from pdserve.engine.engine import EngineCore
from pdserve.prefill.server import PrefillServer
from pdserve.transfer.handoff import HandOff
from tests.fakes import FakeActor
from tests.servers import eventually, executor_of, greedy, one_rank, tiny_engine

PROMPT = list(range(5, 35))  # 30 tokens: 8 pages, chunks [0, 14), [14, 28), [28, 30)
DECODE_PAGES = list(range(40, 48))  # the decode instance's reserved pages


def reservation(pages: list[int] = DECODE_PAGES, local: bool = False) -> Reservation:
    return Reservation("r1", "d0", pages, 0, 30.0, local)


@pytest.fixture
def engine(tiny_path: Path) -> Iterator[EngineCore]:
    engine = tiny_engine(tiny_path)
    yield engine
    engine.shutdown()


@pytest.fixture
def first_token_alone(engine: EngineCore) -> int:
    """The tiny model's greedy first token for PROMPT, from the engine run directly.

    Ask for it before ``server``: once the server's loop runs, it alone steps the engine.
    """
    out = engine.generate([("reference", PROMPT, greedy(1))])[0]
    return out.outputs[0].token_ids[0]


class Decode:
    """The decode leader's side of a hand-off, scripted: ``answer`` is what commit returns."""

    def __init__(self) -> None:
        self.answer: Future[bool] = Future()
        self.actor = FakeActor(
            commit=lambda handoff: self.answer.result(30),
            cancel=lambda request_id: None,
            abort=lambda request_id: True,
        )


@pytest.fixture
def decode() -> Iterator[Decode]:
    decode = Decode()
    yield decode
    if not decode.answer.done():
        decode.answer.set_result(False)


@pytest.fixture
def server(engine: EngineCore, decode: Decode) -> Iterator[PrefillServer]:
    server = PrefillServer("p0", engine, one_rank(engine.model))
    server.register_decode("d0", decode.actor)
    yield server
    server.loop.stop()
    if server.loop.fatal is None:
        engine.check_integrity()


def idle(server: PrefillServer) -> bool:
    return server.loop.wait_idle(10.0)


def queued_behind_the_step(server: PrefillServer) -> bool:
    """Whether a command waits for the running step to end (the loop runs them between steps)."""
    return eventually(lambda: len(server.loop._commands) > 0)


def held(server: PrefillServer) -> set[str]:
    return server.loop.call(lambda engine: set(engine.scheduler.held)).result()


def test_first_token_without_a_reservation_frees_the_pages_at_once(
    first_token_alone: int, server: PrefillServer
) -> None:
    first = server.prefill(PrefillRequest("r1", PROMPT, greedy(8))).result(30)
    assert (first.request_id, first.token_id, first.finished) == ("r1", first_token_alone, False)
    assert first.finish_reason is None
    assert set(first.phases) == {"prefill_queue", "prefill"}
    assert all(plan.kv_sends == [] for plan in executor_of(server.loop.engine).plans)
    assert idle(server)


def test_max_tokens_one_ends_the_request_at_its_first_token(server: PrefillServer) -> None:
    first = server.prefill(PrefillRequest("r1", PROMPT, greedy(1))).result(30)
    assert first == FirstToken("r1", first.token_id, True, "length", first.phases)
    assert idle(server)


def test_pages_stream_chunk_by_chunk_and_a_partial_page_is_sent_again(
    server: PrefillServer, decode: Decode
) -> None:
    server.prefill(PrefillRequest("r1", PROMPT, greedy(8), reservation())).result(30)
    plans = executor_of(server.loop.engine).plans_of("r1")
    assert [(p.seqs[0].start_pos, p.seqs[0].seq_len) for p in plans] == [
        (0, 14),
        (14, 28),
        (28, 30),
    ]
    table = plans[-1].seqs[0].block_table
    sent = [(send.src_blocks, send.dst_blocks, send.final) for p in plans for send in p.kv_sends]
    # Page 3 holds tokens 12-15: it is sent after the first chunk and again once full.
    pages = [[0, 1, 2, 3], [3, 4, 5, 6], [7]]
    assert sent == [
        ([table[i] for i in ps], [DECODE_PAGES[i] for i in ps], final)
        for ps, final in zip(pages, [False, False, True], strict=True)
    ]
    assert all(send.peer == "d0" for p in plans for send in p.kv_sends)


def test_hand_off_names_the_reserved_pages_and_pages_are_held_until_the_answer(
    server: PrefillServer, decode: Decode
) -> None:
    first = server.prefill(PrefillRequest("r1", PROMPT, greedy(8), reservation(), 3)).result(30)
    assert eventually(lambda: decode.actor.called("commit"))
    (handoff,) = decode.actor.called("commit")[0]
    assert handoff == HandOff(
        "r1",
        PROMPT,
        greedy(8),
        first.token_id,
        4,  # the next output index: output_offset + 1
        DECODE_PAGES,
        "p0",
        server.layout,
        handoff.prefilled_at,
    )
    assert handoff.prefilled_at > 0
    assert held(server) == {"r1"}
    decode.answer.set_result(True)
    assert idle(server)
    assert server.stats.committed == 1


@pytest.mark.parametrize(
    ("answer", "refused", "peer_lost"), [(False, 1, 0), (RayActorError(), 1, 1)]
)
def test_a_refused_or_lost_hand_off_frees_the_pages(
    server: PrefillServer, decode: Decode, answer: object, refused: int, peer_lost: int
) -> None:
    if isinstance(answer, BaseException):
        decode.answer.set_exception(answer)
    else:
        decode.answer.set_result(bool(answer))
    server.prefill(PrefillRequest("r1", PROMPT, greedy(8), reservation())).result(30)
    assert idle(server)
    assert (server.stats.committed, server.stats.refused, server.stats.peer_lost) == (
        0,
        refused,
        peer_lost,
    )


def test_a_first_token_that_ends_the_request_cancels_the_reservation(
    server: PrefillServer, decode: Decode
) -> None:
    first = server.prefill(PrefillRequest("r1", PROMPT, greedy(1), reservation())).result(30)
    assert first.finished
    assert idle(server)
    assert decode.actor.called("cancel") == [("r1",)]
    assert decode.actor.called("commit") == []


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (
            PrefillRequest("r1", PROMPT, greedy(8), Reservation("r1", "d9", DECODE_PAGES, 0, 30.0)),
            "reservation.decode_id",
        ),
        (
            PrefillRequest("r1", PROMPT, greedy(8), reservation(DECODE_PAGES[:7])),
            "reservation.block_ids",
        ),
        (
            PrefillRequest("r1", PROMPT, greedy(8), reservation([], local=True)),
            "reservation.block_ids",
        ),
    ],
    ids=["unpaired decode", "too few pages", "local reservation"],
)
def test_a_reservation_that_cannot_take_the_prompt_is_refused(
    server: PrefillServer, request_: PrefillRequest, field: str
) -> None:
    with pytest.raises(InvalidArgumentError) as err:
        server.prefill(request_)
    assert err.value.field == field
    assert idle(server)


def test_drop_while_prefilling_fails_the_first_token_and_frees_everything(
    server: PrefillServer,
) -> None:
    executor = executor_of(server.loop.engine)
    executor.gate = threading.Event()
    first = server.prefill(PrefillRequest("r1", PROMPT, greedy(8), reservation()))
    assert executor.entered.wait(10)  # the first chunk is running
    dropped: list[bool] = []
    dropping = threading.Thread(target=lambda: dropped.append(server.drop("r1")))
    dropping.start()
    assert queued_behind_the_step(server)
    executor.gate.set()
    dropping.join(10)
    assert dropped == [True]
    with pytest.raises(RequestAbortedError):
        first.result(10)
    assert server.stats.aborted == 1
    assert idle(server)
    assert server.drop("r1") is False


def test_a_prompt_whose_drop_overtook_it_is_refused_not_run(server: PrefillServer) -> None:
    # The router's drop runs in the control group and can reach the instance before
    # the prefill call it cancels: that call must not run later into pages the decode
    # instance has given back.
    assert server.drop("r1") is False
    with pytest.raises(RequestAbortedError, match="dropped before it started"):
        server.prefill(PrefillRequest("r1", PROMPT, greedy(8), reservation()))
    assert executor_of(server.loop.engine).plans_of("r1") == []
    assert idle(server)
    assert server.stats.aborted == 1


def test_drop_after_the_first_token_releases_the_held_pages(
    server: PrefillServer, decode: Decode
) -> None:
    server.prefill(PrefillRequest("r1", PROMPT, greedy(8), reservation())).result(30)
    assert held(server) == {"r1"}
    assert server.drop("r1") is True
    assert idle(server)
    decode.answer.set_result(False)  # the late answer finds nothing to free


def test_pages_that_did_not_land_are_never_handed_off(
    server: PrefillServer, decode: Decode
) -> None:
    executor_of(server.loop.engine).deliver = False
    # The request fails alone (the router moves it); the prefill instance serves on.
    with pytest.raises(TransferError, match="KV transfer of r1 to d0 failed"):
        server.prefill(PrefillRequest("r1", PROMPT, greedy(8), reservation())).result(30)
    assert idle(server)
    assert eventually(lambda: decode.actor.called("abort") == [("r1",)])
    assert decode.actor.called("commit") == []
    assert server.stats.aborted == 1
    executor_of(server.loop.engine).deliver = True
    assert server.prefill(PrefillRequest("r2", PROMPT, greedy(1))).result(30).finished


def test_a_request_whose_step_raises_fails_alone_and_frees_its_reservation(
    server: PrefillServer, decode: Decode
) -> None:
    executor_of(server.loop.engine).fail = lambda plan: (
        ValueError("bad request") if any(s.request_id == "r1" for s in plan.seqs) else None
    )
    with pytest.raises(RequestFailedError, match="while prefilling on p0"):
        server.prefill(PrefillRequest("r1", PROMPT, greedy(8), reservation())).result(30)
    assert idle(server)
    assert eventually(lambda: decode.actor.called("cancel") == [("r1",)])
    assert server.stats.aborted == 1


def test_a_dead_rank_fails_every_waiting_first_token(server: PrefillServer) -> None:
    executor_of(server.loop.engine).fail = lambda plan: InstanceFailedError("rank 1 died")
    first = server.prefill(PrefillRequest("r1", PROMPT, greedy(8)))
    with pytest.raises(InstanceFailedError, match="prefill p0 stopped: rank 1 died"):
        first.result(30)
    with pytest.raises(InstanceFailedError):
        server.prefill(PrefillRequest("r2", PROMPT, greedy(8)))


def test_a_forgotten_decode_instance_takes_no_more_reservations(server: PrefillServer) -> None:
    server.forget_decode("d0")
    with pytest.raises(InvalidArgumentError, match="not paired with decode d0"):
        server.prefill(PrefillRequest("r1", PROMPT, greedy(8), reservation()))


def test_forgetting_a_decode_instance_mid_prefill_keeps_the_prefill_serving(
    server: PrefillServer, decode: Decode
) -> None:
    executor = executor_of(server.loop.engine)
    executor.gate = threading.Event()
    first = server.prefill(PrefillRequest("r1", PROMPT, greedy(8), reservation()))
    assert executor.entered.wait(10)  # the first chunk is running
    forgetting = threading.Thread(target=server.forget_decode, args=("d0",))
    forgetting.start()
    assert queued_behind_the_step(server)
    executor.gate.set()
    forgetting.join(10)
    first.result(30)
    assert idle(server)
    assert server.loop.fatal is None
    assert server.stats.peer_lost == 1 and decode.actor.calls == []
    assert server.prefill(PrefillRequest("r2", PROMPT, greedy(1))).result(30).finished
