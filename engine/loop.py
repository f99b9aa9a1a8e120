"""The engine loop of a serving instance: one thread owns the engine core.

Nothing else touches the :class:`~pdserve.engine.engine.EngineCore`. Callers (actor
methods on other threads) hand it work with :meth:`EngineLoop.call`, which runs
a function on the loop thread between steps and returns a future. The loop
runs commands, then due timers, then one step if there is anything to
schedule; with nothing to do it sleeps on a condition until a command or a
timer is due (no polling). Each step's outputs go to ``on_outputs`` on the loop
thread.

If a step raises (a rank died), the loop stops, fails every waiting future
with that error, and reports it through ``on_fatal``.

Health: ``progress_at`` is when the loop last finished a unit of work (a
command, a timer, a step) or woke up to one; :meth:`EngineLoop.problem` says
whether the loop is dead, busy without progress for longer than a deadline
(a hung collective, a command that never returns), or went idle with KV pages
still referenced (a leak: counted each time the engine goes idle). It reads only these two
fields and the thread, never the engine, so it answers while the loop is stuck.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from pdserve.core.errors import InstanceFailedError
from pdserve.core.messages import LoadReport, StepRecord
from pdserve.core.request import RequestOutput
from pdserve.engine.engine import EngineCore

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EngineLoop:
    def __init__(
        self,
        engine: EngineCore,
        on_outputs: Callable[[list[RequestOutput]], None],
        on_fatal: Callable[[BaseException], None] | None = None,
        name: str = "pdserve-engine",
    ) -> None:
        self.engine = engine
        self._on_outputs = on_outputs
        self._on_fatal = on_fatal
        self._commands: deque[tuple[Callable[[EngineCore], Any], Future[Any]]] = deque()
        self._timers: list[tuple[float, int, float, Callable[[EngineCore], None]]] = []
        self._seq = itertools.count()
        self._wake = threading.Condition()
        self._running = True
        self.fatal: BaseException | None = None
        self.steps = 0
        # Exponential moving averages of recent steps, for load reports.
        self.step_seconds = 0.0
        self.step_tokens = 0.0
        self.trace: deque[StepRecord] | None = None  # see step_trace()
        self._idle = threading.Event()  # set while the engine holds no request or page
        # Health (written by the loop thread, read by any): see problem().
        self.progress_at = time.monotonic()
        self._waiting = False  # asleep with nothing to do: no progress is owed
        self.leaked_pages = 0  # pages referenced when the engine last went idle
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Callable[[EngineCore], T]) -> Future[T]:
        """Run ``fn(engine)`` on the loop thread; its result or exception lands in the future."""
        future: Future[T] = Future()
        with self._wake:
            if self.fatal is not None:
                future.set_exception(InstanceFailedError(f"engine stopped: {self.fatal}"))
                return future
            self._commands.append((fn, future))
            self._wake.notify()
        return future

    def every(self, interval_s: float, fn: Callable[[EngineCore], None]) -> None:
        """Run ``fn(engine)`` on the loop thread every ``interval_s`` seconds."""
        with self._wake:
            heapq.heappush(
                self._timers, (time.monotonic() + interval_s, next(self._seq), interval_s, fn)
            )
            self._wake.notify()

    def wait_idle(self, timeout_s: float) -> bool:
        """Block until the engine holds no request, reservation or held page."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.call(lambda engine: engine.is_idle()).result():
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._idle.wait(min(1.0, left))

    def problem(self, stall_after_s: float) -> str | None:
        """Why this loop cannot serve (stopped, died, or stalled), or None when healthy.

        Stalled: the loop has work (it is not asleep waiting for some) and has
        finished nothing for more than ``stall_after_s`` seconds.
        """
        if self.fatal is not None:
            return f"engine loop stopped: {type(self.fatal).__name__}: {self.fatal}"
        if not self._thread.is_alive():
            return "engine loop is not running"
        if self.leaked_pages:
            return f"{self.leaked_pages} KV pages are held with no request left (a leak)"
        busy_for = 0.0 if self._waiting else time.monotonic() - self.progress_at
        if busy_for > stall_after_s:
            return (
                f"engine loop made no progress for {busy_for:.0f} s "
                f"(health.stall_timeout_s = {stall_after_s:g})"
            )
        return None

    def _held_pages(self) -> int:
        """Pages still referenced although no request, reservation or hold is left."""
        kv = self.engine.kv
        return kv.num_blocks - kv.num_free_blocks

    def stop(self, timeout_s: float = 30.0) -> None:
        with self._wake:
            self._running = False
            self._wake.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            while True:
                with self._wake:
                    while self._running and not self._ready():
                        if self.engine.is_idle():
                            self._idle.set()
                            self.leaked_pages = self._held_pages()
                        self._waiting = True
                        self._wake.wait(self._next_timer_in())
                    self._waiting = False
                    self.progress_at = time.monotonic()
                    self._idle.clear()
                    if not self._running:
                        return
                    commands = list(self._commands)
                    self._commands.clear()
                for fn, future in commands:
                    self._run_command(fn, future)
                    self.progress_at = time.monotonic()
                self._run_due_timers()
                self.progress_at = time.monotonic()
                if self.engine.scheduler.has_work:
                    start = time.perf_counter()
                    outputs = self.engine.step()
                    self._record_step(time.perf_counter() - start)
                    self.progress_at = time.monotonic()
                    if outputs:
                        self._on_outputs(outputs)
        except BaseException as e:  # a dead rank or a bug: stop serving, say why
            logger.exception("engine loop stopped")
            self._fail(e)

    def _record_step(self, seconds: float) -> None:
        self.steps += 1
        tokens = float(self.engine.last_step_tokens)
        alpha = 0.2 if self.steps > 1 else 1.0
        self.step_seconds += alpha * (seconds - self.step_seconds)
        self.step_tokens += alpha * (tokens - self.step_tokens)
        if self.trace is not None and self.engine.last_step is not None:
            plan, started, executed = self.engine.last_step
            self.trace.append(
                StepRecord(
                    started,
                    executed,
                    tuple(len(s.token_ids) for s in plan.seqs),
                    tuple(s.start_pos for s in plan.seqs),
                )
            )

    def step_trace(self, keep: int) -> list[StepRecord]:
        """The steps recorded since the last call (oldest first), then record the
        next ``keep`` at most (the newest kept); 0 stops recording. On the loop
        thread (through :meth:`call`)."""
        taken = list(self.trace or ())
        self.trace = deque(maxlen=keep) if keep > 0 else None
        return taken

    def _ready(self) -> bool:
        due = bool(self._timers) and self._timers[0][0] <= time.monotonic()
        return bool(self._commands) or due or self.engine.scheduler.has_work

    def _next_timer_in(self) -> float | None:
        return max(0.0, self._timers[0][0] - time.monotonic()) if self._timers else None

    def _run_command(self, fn: Callable[[EngineCore], Any], future: Future[Any]) -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(self.engine))
        except InstanceFailedError:
            raise
        except Exception as e:  # a refused request: the caller gets the error
            future.set_exception(e)

    def _run_due_timers(self) -> None:
        now = time.monotonic()
        while True:
            with self._wake:
                if not self._timers or self._timers[0][0] > now:
                    return
                _, _, interval, fn = heapq.heappop(self._timers)
                heapq.heappush(self._timers, (now + interval, next(self._seq), interval, fn))
            fn(self.engine)

    def _fail(self, error: BaseException) -> None:
        with self._wake:
            self.fatal = error
            self._running = False
            commands = list(self._commands)
            self._commands.clear()
        for _, future in commands:
            if not future.done():
                future.set_exception(InstanceFailedError(f"engine stopped: {error}"))
        if self._on_fatal is not None:
            self._on_fatal(error)


class LoadReporter:
    """Sends this instance's :class:`LoadReport` to every subscriber, periodically.

    Runs on the engine loop (a timer), so the report sees a consistent engine.
    Subscribers are callables (a router's actor handle wrapped by the caller).
    A report that says nothing new (no KV events, every load figure as last sent)
    is skipped unless ``heartbeat_s`` passed since the last one: an idle instance
    sends one a second, not ten (each costs the router ~1.3 ms of CPU as an actor
    call on a 2-core VM, see docs/results/router.md).
    """

    def __init__(
        self,
        loop: EngineLoop,
        instance_id: str,
        role: str,
        interval_s: float = 0.1,
        heartbeat_s: float = 1.0,
    ) -> None:
        self.loop = loop
        self.instance_id = instance_id
        self.role = role
        self.heartbeat_s = heartbeat_s
        self.sent = 0  # reports sent by the timer
        self._subscribers: list[Callable[[LoadReport], None]] = []
        self._last: LoadReport | None = None
        self._last_at = 0.0
        loop.every(interval_s, self._report)

    def subscribe(self, send: Callable[[LoadReport], None]) -> LoadReport:
        """Add a subscriber; returns a first report with every cached block hash."""

        def add(engine: EngineCore) -> LoadReport:
            self._subscribers.append(send)
            return self._build(engine)

        return self.loop.call(add).result()

    def _build(self, engine: EngineCore) -> LoadReport:
        return engine.load_report(
            self.instance_id, self.role, self.loop.step_seconds, self.loop.step_tokens
        )

    def _report(self, engine: EngineCore) -> None:
        if not self._subscribers:
            return
        report = self._build(engine)
        now = time.monotonic()
        if _same_load(report, self._last) and now - self._last_at < self.heartbeat_s:
            return
        self._last, self._last_at = report, now
        self.sent += 1
        for send in self._subscribers:
            try:
                send(report)
            except Exception:  # a router that went away must not stop the engine
                logger.warning("load report to a subscriber failed", exc_info=True)


def _same_load(report: LoadReport, last: LoadReport | None) -> bool:
    """No KV event in ``report`` and every other field as in ``last``."""
    if last is None:
        return False
    return report == dataclasses.replace(
        last, kv_added=[], kv_removed=[], kv_lower=[], kv_device=[]
    )
