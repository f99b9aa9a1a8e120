"""Stand-ins for Ray in unit tests: actor handles, object refs, and the ``ray`` calls pdserve makes.

A :class:`FakeActor` runs ``actor.method.remote(*args)`` on its own worker
thread, one call at a time in the order they were made (as a Ray actor with the
default ``max_concurrency=1`` does), and returns a :class:`FakeRef`; :data:`FAKE_RAY` replaces a module's ``ray`` (with
``monkeypatch.setattr(module, "ray", FAKE_RAY)``) so its ``ray.get`` and
``ray.wait`` take such refs. Every call is recorded, so a test can assert what
a server sent to its peers. :meth:`FakeActor.kill` makes every later call fail
with ``RayActorError``, as a dead actor's calls do.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

from ray.exceptions import RayActorError


class FakeRef:
    """An object ref: the result of one remote call."""

    def __init__(self, future: Future[Any]) -> None:
        self._future = future

    def future(self) -> Future[Any]:
        return self._future

    def __await__(self) -> Any:  # ``await ref``, as a Ray object ref allows
        return asyncio.wrap_future(self._future).__await__()


class _RemoteMethod:
    def __init__(self, actor: FakeActor, name: str, fn: Callable[..., Any]) -> None:
        self._actor, self._name, self._fn = actor, name, fn

    def remote(self, *args: Any) -> FakeRef:
        return self._actor._call(self._name, self._fn, args)


class FakeActor:
    """An actor handle over plain callables (``FakeActor(commit=fn)``) or an object's methods."""

    def __init__(self, target: object = None, **methods: Callable[..., Any]) -> None:
        self._target = target
        self._methods = methods
        self._pool = ThreadPoolExecutor(max_workers=1)
        self._lock = threading.Lock()
        self.calls: list[tuple[str, tuple[Any, ...]]] = []
        self.dead = False

    def __getattr__(self, name: str) -> _RemoteMethod:
        if name.startswith("_"):
            raise AttributeError(name)
        fn = self._methods.get(name) or getattr(self._target, name, None)
        if fn is None:
            raise AttributeError(f"the fake actor has no method {name!r}")
        return _RemoteMethod(self, name, fn)

    def called(self, name: str) -> list[tuple[Any, ...]]:
        """Arguments of every call of ``name`` so far, in order."""
        with self._lock:
            return [args for n, args in self.calls if n == name]

    def kill(self) -> None:
        self.dead = True

    def _call(self, name: str, fn: Callable[..., Any], args: tuple[Any, ...]) -> FakeRef:
        with self._lock:
            self.calls.append((name, args))
        if self.dead:
            failed: Future[Any] = Future()
            failed.set_exception(RayActorError())
            return FakeRef(failed)
        return FakeRef(self._pool.submit(fn, *args))


def _get(refs: FakeRef | list[FakeRef], timeout: float | None = 60.0) -> Any:
    if isinstance(refs, list):
        return [r.future().result(timeout) for r in refs]
    return refs.future().result(timeout)


def _wait(
    refs: list[FakeRef], num_returns: int = 1, timeout: float | None = None
) -> tuple[list[FakeRef], list[FakeRef]]:
    ready = [r for r in refs if r.future().done()]
    return ready, [r for r in refs if r not in ready]


FAKE_RAY = SimpleNamespace(get=_get, wait=_wait, is_initialized=lambda: False)
