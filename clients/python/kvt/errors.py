"""Exceptions of the kvt client: one class per canonical gRPC status code, each carrying the code
and the server's message (which names the offending request field)."""

from __future__ import annotations

from typing import Dict, Optional, Type

import grpc


class KvtError(Exception):
    """A failed kvt call. `code` is the canonical gRPC status; `details` the server's message."""

    code: grpc.StatusCode = grpc.StatusCode.UNKNOWN

    def __init__(self, details: str, code: Optional[grpc.StatusCode] = None) -> None:
        if code is not None:
            self.code = code
        self.details = details
        super().__init__(f"{self.code.name}: {details}")


class InvalidArgumentError(KvtError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class NotFoundError(KvtError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExistsError(KvtError):
    code = grpc.StatusCode.ALREADY_EXISTS


class PermissionDeniedError(KvtError):
    code = grpc.StatusCode.PERMISSION_DENIED


class UnauthenticatedError(KvtError):
    code = grpc.StatusCode.UNAUTHENTICATED


class ResourceExhaustedError(KvtError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class FailedPreconditionError(KvtError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class OutOfRangeError(KvtError):
    code = grpc.StatusCode.OUT_OF_RANGE


class UnavailableError(KvtError):
    code = grpc.StatusCode.UNAVAILABLE


class DeadlineExceededError(KvtError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class CancelledError(KvtError):
    code = grpc.StatusCode.CANCELLED


class UnimplementedError(KvtError):
    code = grpc.StatusCode.UNIMPLEMENTED


class InternalError(KvtError):
    """Also raised when the server's stream breaks the protocol (missing or repeated chunks)."""

    code = grpc.StatusCode.INTERNAL


_BY_CODE: Dict[grpc.StatusCode, Type[KvtError]] = {
    cls.code: cls
    for cls in (InvalidArgumentError, NotFoundError, AlreadyExistsError, PermissionDeniedError,
                UnauthenticatedError, ResourceExhaustedError, FailedPreconditionError,
                OutOfRangeError, UnavailableError, DeadlineExceededError, CancelledError,
                UnimplementedError, InternalError)
}


def error_for(code: grpc.StatusCode, details: str) -> KvtError:
    """The exception of `code` (KvtError itself for codes without a class of their own)."""
    cls = _BY_CODE.get(code)
    return cls(details) if cls is not None else KvtError(details, code)


def from_rpc_error(error: grpc.RpcError) -> KvtError:
    """Turns a grpc.RpcError (which is also a grpc.Call) into the matching KvtError."""
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    return error_for(code or grpc.StatusCode.UNKNOWN, details or "")
