"""Errors a pdserve user can meet, and the one table that maps them to wire codes.

Every exception raised across a public boundary (the offline API, the command
line, gRPC, HTTP) is a :class:`PdserveError`. Each subclass carries the gRPC
status name and the HTTP status it maps to, so the front doors translate them
in one place (:func:`wire_status`) instead of each keeping its own table.
"""

from __future__ import annotations

from dataclasses import dataclass


class PdserveError(Exception):
    """Base class of every error pdserve raises on purpose."""

    grpc_code: str = "INTERNAL"
    http_status: int = 500

    def __reduce__(self) -> tuple[object, ...]:
        # Errors cross Ray actor boundaries: rebuild them with their fields,
        # whatever their constructor takes.
        return (_rebuild, (type(self), str(self), dict(self.__dict__)))


def _rebuild(cls: type[PdserveError], message: str, state: dict[str, object]) -> PdserveError:
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(state)
    return error


class InvalidArgumentError(PdserveError, ValueError):
    """A request or configuration value is malformed; ``field`` names it."""

    grpc_code = "INVALID_ARGUMENT"
    http_status = 400

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class NotFoundError(InvalidArgumentError):
    """A request names something (a file, a batch) that does not exist, or not for its key."""

    grpc_code = "NOT_FOUND"
    http_status = 404


class ConflictError(InvalidArgumentError):
    """A well-formed request that what the server holds now forbids (a file a running
    batch reads, an adapter requests use); it may succeed later."""

    grpc_code = "FAILED_PRECONDITION"
    http_status = 409


class ModelNotFoundError(InvalidArgumentError):
    """The model path or name does not resolve to a checkpoint pdserve can load."""


class UnsupportedError(PdserveError):
    """A valid request for something pdserve does not do (yet)."""

    grpc_code = "UNIMPLEMENTED"
    http_status = 501


class OverloadedError(PdserveError):
    """Admission control refused the request; retry after ``retry_after_s``."""

    grpc_code = "RESOURCE_EXHAUSTED"
    http_status = 429

    def __init__(self, message: str, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class AuthenticationError(PdserveError):
    """The API key is missing or unknown."""

    grpc_code = "UNAUTHENTICATED"
    http_status = 401


class PermissionDeniedError(PdserveError):
    """The API key is known but may not do this (an admin call with a client's key)."""

    grpc_code = "PERMISSION_DENIED"
    http_status = 403


class RequestAbortedError(PdserveError):
    """The request was cancelled by its client or by the server."""

    grpc_code = "CANCELLED"
    http_status = 499


class InstanceFailedError(PdserveError):
    """A worker instance died or stopped answering; the message says which."""

    grpc_code = "UNAVAILABLE"
    http_status = 503


class TransferError(PdserveError):
    """KV pages could not be delivered to a decode instance."""

    grpc_code = "UNAVAILABLE"
    http_status = 503


class RequestFailedError(PdserveError):
    """One request failed inside an engine; the others on that instance went on.

    The request is not retried elsewhere: whatever made it fail would follow it.
    """

    grpc_code = "INTERNAL"
    http_status = 500


@dataclass(frozen=True)
class WireStatus:
    """How one error is spelled on the wire."""

    grpc_code: str
    http_status: int
    message: str


def wire_status(exc: BaseException) -> WireStatus:
    """Map any exception to its gRPC status name and HTTP status.

    Errors pdserve raises on purpose keep their own codes; anything else is an
    internal error whose message is not trusted to be user-facing.
    """
    if isinstance(exc, PdserveError):
        return WireStatus(exc.grpc_code, exc.http_status, str(exc))
    return WireStatus("INTERNAL", 500, f"internal error: {type(exc).__name__}")


def first_line(error: BaseException) -> str:
    """An error's message for one line of output: its first line, else its type's name."""
    lines = str(error).strip().splitlines()
    return lines[0] if lines else type(error).__name__
