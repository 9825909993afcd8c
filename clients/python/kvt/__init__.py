"""kvt: Python client of kvtd, the cross-model KV cache translation service (kvt.v1 gRPC API).

    import kvt
    with kvt.Client("127.0.0.1:50051") as client:
        result = client.translate(kvt.KVCache(k=keys, v=values), mapper_id="demo-tiny")

The core needs numpy, grpcio and protobuf only; kvt.adapters converts to and from torch tensors
and Hugging Face DynamicCache and imports torch/transformers when first used.
"""

# The generated stubs (kvt._proto) may live in a second `kvt` directory on sys.path (Bazel puts
# them under the package's genfiles); extend_path makes both directories one package.
from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)

from kvt._proto.common_pb2 import PagedBlocks  # noqa: E402
from kvt.cache import KVCache  # noqa: E402
from kvt.client import Client  # noqa: E402
from kvt.errors import (AlreadyExistsError, CancelledError, DeadlineExceededError,  # noqa: E402
                        FailedPreconditionError, InternalError, InvalidArgumentError, KvtError,
                        NotFoundError, OutOfRangeError, PermissionDeniedError,
                        ResourceExhaustedError, UnauthenticatedError, UnavailableError,
                        UnimplementedError)
from kvt.response import TranslateResult  # noqa: E402
from kvt.session import Session  # noqa: E402
from kvt.shm import SharedMemoryRegion  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "AlreadyExistsError", "CancelledError", "Client", "DeadlineExceededError",
    "FailedPreconditionError", "InternalError", "InvalidArgumentError", "KVCache", "KvtError",
    "NotFoundError", "OutOfRangeError", "PagedBlocks", "PermissionDeniedError",
    "ResourceExhaustedError",
    "Session", "SharedMemoryRegion", "TranslateResult", "UnauthenticatedError", "UnavailableError",
    "UnimplementedError",
]
