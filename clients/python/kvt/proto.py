"""The generated kvt.v1 message and stub modules (proto/kvt/v1), for code that builds requests
or reads responses itself (a raw gRPC stub, a recorded response stream); kvt.Client covers the
API without them.

    from kvt.proto import translate_pb2
"""

from kvt._proto import (common_pb2, health_pb2, health_pb2_grpc, mappers_pb2, memory_pb2,
                        prefix_cache_pb2, prefix_cache_pb2_grpc, service_pb2, service_pb2_grpc,
                        translate_pb2, validate_pb2)

__all__ = [
    "common_pb2", "health_pb2", "health_pb2_grpc", "mappers_pb2", "memory_pb2",
    "prefix_cache_pb2", "prefix_cache_pb2_grpc", "service_pb2", "service_pb2_grpc",
    "translate_pb2", "validate_pb2",
]
