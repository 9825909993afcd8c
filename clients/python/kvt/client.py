"""kvt.Client: the Python client of the kvt.v1 API (kvtd) for routers and evaluation tools.

It mirrors the C++ client (client/client.cc): a TranslateKV stream carries one header and then
every source layer's K and V in token-range chunks of at most `chunk_bytes`, layers in order
(so a pipelining server can start on early layers); the response (header, target chunks,
trailer) is reassembled with a check that every target token of every layer arrives exactly
once. Every gRPC failure becomes a KvtError subclass carrying the status code and the server's
message.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator, List, Optional, Sequence, Tuple, Union

import grpc
import numpy as np

from kvt._proto import (common_pb2, health_pb2, health_pb2_grpc, mappers_pb2, memory_pb2,
                        service_pb2, service_pb2_grpc, translate_pb2, validate_pb2)
from kvt.cache import DTYPES, ELEMENT_SIZE, LAYOUTS, KVCache
from kvt.errors import (FailedPreconditionError, InternalError, InvalidArgumentError, KvtError,
                        NotFoundError, UnimplementedError, from_rpc_error)
from kvt.prefix import cached_translate_header
from kvt.response import Reassembler, TranslateResult
from kvt.shm import SharedMemoryRegion

Pem = Union[str, bytes]

# Room left in each message for the chunk's other fields and framing.
_MESSAGE_OVERHEAD = 64 << 10


def _pem(value: Optional[Pem]) -> Optional[bytes]:
    if value is None:
        return None
    return value.encode() if isinstance(value, str) else value


class Client:
    """A connection to one kvtd. Thread-safe: calls may run concurrently from several threads.

    target: "host:port" or "unix:/path/to/socket".
    timeout: default per-call deadline in seconds (None = no deadline); every method also takes
        its own `timeout`.
    max_message_bytes: largest gRPC message either way; keep it at or below the server's
        server.max_message_bytes (64 MiB by default).
    chunk_bytes: KV bytes per request chunk (a few MiB is ideal; capped below max_message_bytes).
    tls_root_ca: PEM of the CA that signed kvtd's certificate; set it to use TLS.
    tls_client_cert / tls_client_key: PEM client certificate and key for mTLS.
    tls_server_name: overrides the name checked against the server certificate.
    bearer_token: sent as "authorization: Bearer <token>" on every call.
    max_request_tokens: split translate() calls with more tokens into consecutive requests of
        at most this many, the result the same as one request's (a window mapper's requests
        after the first start window - 1 tokens early, their outputs dropped); set it to the
        server's limits.max_tokens to stay under it. None: never split.
    """

    def __init__(self, target: str, *, timeout: Optional[float] = 300.0,
                 max_message_bytes: int = 64 << 20, chunk_bytes: int = 4 << 20,
                 tls_root_ca: Optional[Pem] = None, tls_client_cert: Optional[Pem] = None,
                 tls_client_key: Optional[Pem] = None, tls_server_name: Optional[str] = None,
                 bearer_token: Optional[str] = None, max_request_tokens: Optional[int] = None,
                 channel_options: Sequence[Tuple[str, Any]] = ()) -> None:
        if max_message_bytes <= _MESSAGE_OVERHEAD:
            raise InvalidArgumentError(f"max_message_bytes {max_message_bytes} is too small")
        if chunk_bytes <= 0:
            raise InvalidArgumentError(f"chunk_bytes must be > 0, got {chunk_bytes}")
        if max_request_tokens is not None and max_request_tokens <= 0:
            raise InvalidArgumentError(f"max_request_tokens must be > 0: {max_request_tokens}")
        self.max_request_tokens = max_request_tokens
        if (tls_client_cert is None) != (tls_client_key is None):
            raise InvalidArgumentError("tls_client_cert and tls_client_key go together")
        if tls_client_cert is not None and tls_root_ca is None:
            raise InvalidArgumentError("mTLS (tls_client_cert) needs tls_root_ca")
        self.target = target
        self.timeout = timeout
        self.max_message_bytes = max_message_bytes
        self.chunk_bytes = min(chunk_bytes, max_message_bytes - _MESSAGE_OVERHEAD)
        self._metadata: Tuple[Tuple[str, str], ...] = (
            (("authorization", f"Bearer {bearer_token}"),) if bearer_token else ())
        options: List[Tuple[str, Any]] = [
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.max_receive_message_length", max_message_bytes),
        ]
        if tls_server_name:
            options.append(("grpc.ssl_target_name_override", tls_server_name))
        options.extend(channel_options)
        if tls_root_ca is not None:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=_pem(tls_root_ca), private_key=_pem(tls_client_key),
                certificate_chain=_pem(tls_client_cert))
            self._channel = grpc.secure_channel(target, credentials, options=options)
        else:
            self._channel = grpc.insecure_channel(target, options=options)
        self._stub = service_pb2_grpc.KvTranslatorStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    # -- plumbing -----------------------------------------------------------------------------

    def close(self) -> None:
        self._channel.close()

    def watch_connection(self, callback: Callable[[bool], None]) -> None:
        """Calls `callback(connected)` now and on every change of the channel's connectivity
        (on gRPC's thread): False when the connection to kvtd is lost (kvtd stopped or
        restarted) or idle, True once it is up again."""
        self._channel.subscribe(
            lambda state: callback(state == grpc.ChannelConnectivity.READY), try_to_connect=False)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def stub(self) -> service_pb2_grpc.KvTranslatorStub:
        """The generated stub, for anything this class does not wrap."""
        return self._stub

    def _timeout(self, timeout: Optional[float]) -> Optional[float]:
        return self.timeout if timeout is None else timeout

    def _unary(self, method: Any, request: Any, timeout: Optional[float]) -> Any:
        try:
            return method(request, timeout=self._timeout(timeout), metadata=self._metadata)
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None

    # -- health and mappers -------------------------------------------------------------------

    def health(self, service: str = "", timeout: Optional[float] = None) -> str:
        """grpc.health.v1 Check: "SERVING", "NOT_SERVING", ... for `service` ("" = the server)."""
        response = self._unary(self._health.Check, health_pb2.HealthCheckRequest(service=service),
                               timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def server_metadata(self, timeout: Optional[float] = None
                        ) -> service_pb2.ServerMetadataResponse:
        """kvtd's name, release and the protocol extensions it understands. UnimplementedError:
        a kvtd older than the RPC (none of the extensions a newer client tests for)."""
        return self._unary(self._stub.ServerMetadata, service_pb2.ServerMetadataRequest(),
                           timeout)

    def has_extension(self, extension: str, timeout: Optional[float] = None) -> bool:
        """Whether kvtd lists `extension` in ServerMetadata (e.g. "paged_engine_order"); False
        for a kvtd older than the RPC. A server ignores request fields it does not know, so a
        client asks before it relies on one."""
        try:
            return extension in self.server_metadata(timeout).extensions
        except UnimplementedError:
            return False

    def list_mappers(self, timeout: Optional[float] = None) -> List[mappers_pb2.MapperInfo]:
        return list(self._unary(self._stub.ListMappers, mappers_pb2.ListMappersRequest(),
                                timeout).mappers)

    def get_mapper(self, mapper_id: str, timeout: Optional[float] = None
                   ) -> mappers_pb2.MapperInfo:
        return self._unary(self._stub.GetMapper, mappers_pb2.GetMapperRequest(mapper_id=mapper_id),
                           timeout)

    def load_mapper(self, mapper_id: str, device: str = "", timeout: Optional[float] = None
                    ) -> mappers_pb2.MapperInfo:
        """Loads onto "host" (default) or a device such as "cuda:0". Admin role under auth."""
        request = mappers_pb2.LoadMapperRequest(mapper_id=mapper_id, device=device)
        return self._unary(self._stub.LoadMapper, request, timeout).mapper

    def unload_mapper(self, mapper_id: str, device: str = "", timeout: Optional[float] = None
                      ) -> mappers_pb2.MapperInfo:
        """Drops from every tier ("") or one device. Admin role under auth."""
        request = mappers_pb2.UnloadMapperRequest(mapper_id=mapper_id, device=device)
        return self._unary(self._stub.UnloadMapper, request, timeout).mapper

    def find_mapper(self, source_model: str = "", target_model: str = "", mapper_id: str = "",
                    timeout: Optional[float] = None) -> mappers_pb2.MapperInfo:
        """The mapper a translation of this pair (or id) would use; NotFoundError if none."""
        if mapper_id:
            return self.get_mapper(mapper_id, timeout)
        if not source_model or not target_model:
            raise InvalidArgumentError("set mapper_id, or both source_model and target_model")
        for info in self.list_mappers(timeout):
            if (info.source_model == source_model and info.target_model == target_model and
                    info.state != mappers_pb2.MAPPER_STATE_FAILED):
                return info
        raise NotFoundError(f"no mapper for {source_model} -> {target_model}")

    # -- TranslateKV ---------------------------------------------------------------------------

    @staticmethod
    def _translate_header(num_tokens: int, dtype: str, layout: str, mapper_id: str,
                          source_model: str, target_model: str, position_offset: int,
                          positions: Optional[Sequence[int]], output_dtype: Optional[str],
                          output_layout: Optional[str], request_id: str, session_id: str,
                          turn: int, reprefill_estimate_ms: float
                          ) -> translate_pb2.TranslateHeader:
        if not mapper_id and not (source_model and target_model):
            raise InvalidArgumentError(
                "header: set mapper_id, or both source_model and target_model")
        if output_dtype is not None and output_dtype not in DTYPES:
            raise InvalidArgumentError(f"output_dtype: unknown dtype {output_dtype!r}")
        if output_layout is not None and output_layout not in LAYOUTS:
            raise InvalidArgumentError(f"output_layout: unknown layout {output_layout!r}")
        if position_offset < 0:
            raise InvalidArgumentError(f"position_offset must be >= 0, got {position_offset}")
        header = translate_pb2.TranslateHeader(
            request_id=request_id, source_model=source_model, target_model=target_model,
            mapper_id=mapper_id, dtype=DTYPES[dtype], layout=LAYOUTS[layout],
            output_dtype=DTYPES[output_dtype] if output_dtype else common_pb2.DTYPE_UNSPECIFIED,
            output_layout=(LAYOUTS[output_layout] if output_layout
                           else common_pb2.LAYOUT_UNSPECIFIED),
            num_tokens=num_tokens, position_offset=position_offset, session_id=session_id,
            turn=turn, reprefill_estimate_ms=reprefill_estimate_ms)
        if positions is not None:
            positions = [int(p) for p in positions]
            if len(positions) != num_tokens or min(positions) < 0:
                raise InvalidArgumentError(
                    f"positions: need {num_tokens} entries >= 0, got {len(positions)}")
            header.positions.extend(positions)
        return header

    def translate(self, source: KVCache, *, mapper_id: str = "", source_model: str = "",
                  target_model: str = "", position_offset: int = 0,
                  positions: Optional[Sequence[int]] = None, output_dtype: Optional[str] = None,
                  output_layout: Optional[str] = None, request_id: str = "",
                  session_id: str = "", turn: int = 0, reprefill_estimate_ms: float = 0.0,
                  response_chunk_tokens: int = 0, timeout: Optional[float] = None
                  ) -> TranslateResult:
        """Translates `source` (the source model's cache) into the target model's cache.

        Name the pair (source_model and target_model) or a mapper_id. Token i sits at absolute
        position position_offset + i unless `positions` lists all of them. The result is in
        output_dtype / output_layout (default: the source's). With max_request_tokens set, a
        longer cache goes as several consecutive requests whose results are concatenated; for a
        window mapper (MapperInfo.window w > 1, learned with one find_mapper call) each request
        after the first starts w - 1 tokens early and their outputs are dropped, so the result
        equals one request's (docs/MAPPER_FORMAT.md, "Window mappers"). A response that names a
        wider window (the mapper hot-reloaded meanwhile) makes the split again with it.
        """
        limit = self.max_request_tokens
        if limit is not None and source.num_tokens > limit:
            if positions is not None and len(positions) != source.num_tokens:
                raise InvalidArgumentError(
                    f"positions: need {source.num_tokens} entries, got {len(positions)}")
            info = self.find_mapper(source_model, target_model, mapper_id, timeout)
            window = max(1, info.window)
            # Each response names the window that served it; a wider one (the mapper reloaded
            # between the lookup and a request) makes the split again with it.
            for _ in range(3):
                parts = self._translate_split(source, limit, window, info.mapper_id, dict(
                    mapper_id=mapper_id, source_model=source_model, target_model=target_model,
                    output_dtype=output_dtype, output_layout=output_layout,
                    session_id=session_id, turn=turn,
                    reprefill_estimate_ms=reprefill_estimate_ms,
                    response_chunk_tokens=response_chunk_tokens, timeout=timeout),
                    position_offset, positions, request_id)
                if isinstance(parts, list):
                    return _combine(parts)
                window = parts
            raise FailedPreconditionError(
                f"mapper {info.mapper_id!r} changed its window during every split of this call "
                f"(last window {window}); retry")
        header = self._translate_header(
            source.num_tokens, source.dtype or "fp32", source.layout, mapper_id, source_model,
            target_model, position_offset, positions, output_dtype, output_layout, request_id,
            session_id, turn, reprefill_estimate_ms)
        if response_chunk_tokens:
            header.output.inline.chunk_tokens = response_chunk_tokens

        def requests() -> Iterator[translate_pb2.TranslateKVRequest]:
            yield translate_pb2.TranslateKVRequest(header=header)
            for layer, kind, start, count, data in source.chunks(self.chunk_bytes):
                yield translate_pb2.TranslateKVRequest(chunk=common_pb2.KVChunk(
                    layer=layer, kind=kind, token_start=start, token_count=count, data=data))

        call = self._stub.TranslateKV(requests(), timeout=self._timeout(timeout),
                                      metadata=self._metadata)
        return Reassembler(call).run()

    def _translate_split(self, source: KVCache, limit: int, window: int, mapper_name: str,
                         fields: dict, position_offset: int,
                         positions: Optional[Sequence[int]], request_id: str
                         ) -> Union[List[TranslateResult], int]:
        """translate() of `source` as consecutive requests of at most `limit` tokens for a
        mapper of `window`: each after the first starts window - 1 tokens early, and their
        outputs are dropped. Returns the parts, or the wider window a response named (the
        parts then do not equal one request)."""
        reach = window - 1
        if limit <= reach:
            raise InvalidArgumentError(
                f"max_request_tokens={limit} leaves no room for new tokens beside the "
                f"{reach} earlier ones mapper {mapper_name!r} (window {window}) reads; make it "
                f"larger than {reach}")
        parts: List[TranslateResult] = []
        for begin in range(0, source.num_tokens, limit - reach):
            end = min(begin + limit - reach, source.num_tokens)
            early = min(reach, begin)
            part = self.translate(
                source.slice_tokens(begin - early, end), position_offset=position_offset +
                begin - early,
                positions=None if positions is None else list(positions)[begin - early:end],
                request_id=f"{request_id}/{len(parts)}" if request_id else "", **fields)
            served = part.header.window
            if served - 1 > early and begin > early:
                return served
            parts.append(part.drop_leading(early))
        return parts

    def translate_layers(self, layers: Iterable[Tuple[np.ndarray, np.ndarray]], *,
                         num_layers: int, num_tokens: int, dtype: str = "fp32",
                         layout: str = "HND", mapper_id: str = "", source_model: str = "",
                         target_model: str = "", position_offset: int = 0,
                         positions: Optional[Sequence[int]] = None,
                         output_dtype: Optional[str] = None, output_layout: Optional[str] = None,
                         request_id: str = "", session_id: str = "", turn: int = 0,
                         reprefill_estimate_ms: float = 0.0, response_chunk_tokens: int = 0,
                         timeout: Optional[float] = None) -> TranslateResult:
        """translate() of a source cache produced layer by layer: `layers` yields (K, V) of
        layer 0, 1, ... (arrays as in KVCache) and is consumed while the stream is open, so a
        pipelining kvtd computes and returns target layers whose source layers have arrived
        while later ones are still being produced (e.g. by a running prefill). A layer of the
        wrong shape, or too few or too many layers, ends the call with InvalidArgumentError; an
        exception raised by `layers` itself ends it and is re-raised here."""
        if dtype not in DTYPES or layout not in LAYOUTS:
            raise InvalidArgumentError(f"dtype/layout: unknown {dtype!r}/{layout!r}")
        header = self._translate_header(
            num_tokens, dtype, layout, mapper_id, source_model, target_model, position_offset,
            positions, output_dtype, output_layout, request_id, session_id, turn,
            reprefill_estimate_ms)
        if response_chunk_tokens:
            header.output.inline.chunk_tokens = response_chunk_tokens
        # Errors of the layer producer (or of its layers) end the upload early; they are raised
        # instead of the server's "tokens missing" that follows.
        problems: List[Exception] = []
        chunk_bytes = self.chunk_bytes
        shape: List[Tuple[int, ...]] = []

        def requests() -> Iterator[translate_pb2.TranslateKVRequest]:
            yield translate_pb2.TranslateKVRequest(header=header)
            count = 0
            produced = iter(layers)
            while True:
                try:
                    k, v = next(produced)
                except StopIteration:
                    break
                except Exception as error:  # the caller's producer failed: report it as is
                    problems.append(error)
                    return
                if count == num_layers:
                    problems.append(InvalidArgumentError(
                        f"layers: more than num_layers={num_layers} layers"))
                    return
                try:
                    one = KVCache(k=[k], v=[v], layout=layout, dtype=dtype)
                    if one.num_tokens != num_tokens or (shape and one.k[0].shape != shape[0]):
                        raise InvalidArgumentError(
                            f"layer {count} has shape {one.k[0].shape}; expected "
                            f"{shape[0] if shape else f'{num_tokens} tokens'}")
                except KvtError as error:
                    problems.append(InvalidArgumentError(f"layers: layer {count}: {error.details}"))
                    return
                shape[:] = [one.k[0].shape]
                for _, kind, start, tokens, data in one.chunks(chunk_bytes):
                    yield translate_pb2.TranslateKVRequest(chunk=common_pb2.KVChunk(
                        layer=count, kind=kind, token_start=start, token_count=tokens,
                        data=data))
                count += 1
            if count < num_layers:
                problems.append(InvalidArgumentError(
                    f"layers: {count} layers produced, num_layers={num_layers}"))

        call = self._stub.TranslateKV(requests(), timeout=self._timeout(timeout),
                                      metadata=self._metadata)
        try:
            result = Reassembler(call).run()
        except KvtError:
            if problems:  # the server only saw a short stream; say what was wrong with it
                raise problems[0]
            raise
        if problems:
            raise problems[0]
        return result

    def translate_regions(self, *, input_region: str, output_region: str, num_tokens: int,
                          dtype: str, input_byte_size: int, output_byte_size: int,
                          input_offset: int = 0, output_offset: int = 0, layout: str = "HND",
                          mapper_id: str = "", source_model: str = "", target_model: str = "",
                          position_offset: int = 0, positions: Optional[Sequence[int]] = None,
                          output_dtype: Optional[str] = None, output_layout: Optional[str] = None,
                          request_id: str = "", session_id: str = "", turn: int = 0,
                          reprefill_estimate_ms: float = 0.0,
                          input_paged: Optional[common_pb2.PagedBlocks] = None,
                          output_paged: Optional[common_pb2.PagedBlocks] = None,
                          timeout: Optional[float] = None) -> TranslateResult:
        """A translation whose source cache lies in a registered region and whose result is
        written into another (or the same) registered region; see SharedMemoryRegion. Packed
        layer-major by default; `input_paged` / `output_paged` (kvt.PagedBlocks: num_blocks,
        block_size, block_table) declare vLLM's paged layout on that side instead, blocks
        ordered by `layout` / `output_layout` (kvt.cache.read_paged / write_paged convert).
        The returned result's `target` is None: the bytes are in the output region."""
        if dtype not in DTYPES:
            raise InvalidArgumentError(f"dtype: unknown dtype {dtype!r}")
        if layout not in LAYOUTS:
            raise InvalidArgumentError(f"layout: unknown layout {layout!r}")
        header = self._translate_header(
            num_tokens, dtype, layout, mapper_id, source_model, target_model, position_offset,
            positions, output_dtype, output_layout, request_id, session_id, turn,
            reprefill_estimate_ms)
        header.input.region.CopyFrom(common_pb2.RegionRef(
            region=input_region, offset=input_offset, byte_size=input_byte_size))
        header.output.region.CopyFrom(common_pb2.RegionRef(
            region=output_region, offset=output_offset, byte_size=output_byte_size))
        if input_paged is not None:
            header.input.region.paged.CopyFrom(input_paged)
        if output_paged is not None:
            header.output.region.paged.CopyFrom(output_paged)
        call = self._stub.TranslateKV(iter([translate_pb2.TranslateKVRequest(header=header)]),
                                      timeout=self._timeout(timeout), metadata=self._metadata)
        return Reassembler(call, expect_chunks=False).run()

    def translate_via_shm(self, source: KVCache, *, mapper_id: str = "", source_model: str = "",
                          target_model: str = "", output_dtype: Optional[str] = None,
                          output_layout: Optional[str] = None, timeout: Optional[float] = None,
                          **header_fields: Any) -> TranslateResult:
        """translate() through one temporary POSIX shared-memory region instead of inline
        chunks: created, registered, filled, translated in place, read back, and unregistered
        and unlinked whatever happens. The server must allow client regions (admin role under
        auth). Returns the target cache like translate()."""
        info = self.find_mapper(source_model, target_model, mapper_id, timeout)
        dtype = output_dtype or source.dtype or "fp32"
        layout = output_layout or source.layout
        shape = info.target_shape
        out_bytes = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * \
            source.num_tokens * ELEMENT_SIZE[dtype]
        in_bytes = source.nbytes
        out_offset = (in_bytes + 63) // 64 * 64
        with SharedMemoryRegion(self, out_offset + out_bytes, timeout=timeout) as region:
            region.write_cache(source, offset=0)
            result = self.translate_regions(
                input_region=region.name, output_region=region.name,
                num_tokens=source.num_tokens, dtype=source.dtype or "fp32",
                input_byte_size=in_bytes, output_byte_size=out_bytes, output_offset=out_offset,
                layout=source.layout, mapper_id=mapper_id, source_model=source_model,
                target_model=target_model, output_dtype=output_dtype,
                output_layout=output_layout, timeout=timeout, **header_fields)
            result.target = region.read_cache(
                out_offset, shape.num_layers, shape.num_kv_heads, shape.head_dim,
                source.num_tokens, dtype, layout)
        return result

    def translate_cached(self, lease_id: str, mapper_id: str, num_tokens: int, *,
                         dtype: str = "fp32", output_dtype: Optional[str] = None,
                         output_layout: str = "NHD", request_id: str = "",
                         response_chunk_tokens: int = 0, timeout: Optional[float] = None
                         ) -> TranslateResult:
        """TranslateKV of a prefix the server's source-cache tier holds, leased by
        kvt.prefix.PrefixCache.lookup (`dtype` = the lookup's dtype, num_tokens = its
        matched_tokens): only the header is sent; the target cache comes back inline."""
        header = cached_translate_header(lease_id, mapper_id, num_tokens, dtype=dtype,
                                         output_dtype=output_dtype, output_layout=output_layout,
                                         request_id=request_id,
                                         response_chunk_tokens=response_chunk_tokens)
        call = self._stub.TranslateKV(iter([translate_pb2.TranslateKVRequest(header=header)]),
                                      timeout=self._timeout(timeout), metadata=self._metadata)
        return Reassembler(call).run()

    # -- ValidateKV ----------------------------------------------------------------------------

    def validate(self, source: KVCache, target_true: KVCache, queries: Optional[KVCache] = None,
                 *, mapper_id: str = "", source_model: str = "", target_model: str = "",
                 position_offset: int = 0, positions: Optional[Sequence[int]] = None,
                 request_id: str = "", turn: int = 0, timeout: Optional[float] = None
                 ) -> validate_pb2.ValidateKVResponse:
        """SPEC 5 quality of the mapper on `source` against the target's own cache of the same
        tokens: per-layer and overall R^2 and cosine; with `queries` (the target's post-RoPE
        queries as a cache whose K arrays have the query heads; V is ignored) also the
        attention-output cosine and c_K / c_V."""
        caches = [("source", source), ("target_true", target_true)]
        if queries is not None:
            caches.append(("queries", queries))
        for name, cache in caches[1:]:
            if (cache.dtype != source.dtype or cache.layout != source.layout or
                    cache.num_tokens != source.num_tokens):
                raise InvalidArgumentError(
                    f"{name}: dtype/layout/tokens {cache.dtype}/{cache.layout}/{cache.num_tokens}"
                    f" differ from source's {source.dtype}/{source.layout}/{source.num_tokens}")
        if not mapper_id and not (source_model and target_model):
            raise InvalidArgumentError(
                "header: set mapper_id, or both source_model and target_model")
        header = validate_pb2.ValidateHeader(
            request_id=request_id, source_model=source_model, target_model=target_model,
            mapper_id=mapper_id, dtype=DTYPES[source.dtype or "fp32"],
            layout=LAYOUTS[source.layout], num_tokens=source.num_tokens,
            position_offset=position_offset,
            num_query_heads=queries.num_kv_heads if queries is not None else 0, turn=turn)
        if positions is not None:
            if len(positions) != source.num_tokens:
                raise InvalidArgumentError(
                    f"positions: need {source.num_tokens} entries, got {len(positions)}")
            header.positions.extend(int(p) for p in positions)
        roles = [(validate_pb2.VALIDATE_ROLE_SOURCE, source, False),
                 (validate_pb2.VALIDATE_ROLE_TARGET_TRUE, target_true, False)]
        if queries is not None:
            roles.append((validate_pb2.VALIDATE_ROLE_TARGET_QUERY, queries, True))
        chunk_bytes = self.chunk_bytes

        def requests() -> Iterator[validate_pb2.ValidateKVRequest]:
            yield validate_pb2.ValidateKVRequest(header=header)
            for role, cache, keys_only in roles:
                for layer, kind, start, count, data in cache.chunks(chunk_bytes, keys_only):
                    yield validate_pb2.ValidateKVRequest(chunk=validate_pb2.ValidateChunk(
                        role=role, chunk=common_pb2.KVChunk(layer=layer, kind=kind,
                                                            token_start=start,
                                                            token_count=count, data=data)))

        try:
            return self._stub.ValidateKV(requests(), timeout=self._timeout(timeout),
                                         metadata=self._metadata)
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None

    # -- shared memory -------------------------------------------------------------------------

    def register_system_memory(self, name: str, key: str, byte_size: int, offset: int = 0,
                               timeout: Optional[float] = None) -> None:
        """Registers POSIX shm object `key` ("/name" as for shm_open), bytes [offset, offset +
        byte_size), under `name`. Prefer SharedMemoryRegion, which also creates and cleans up."""
        self._unary(self._stub.RegisterSystemMemory, memory_pb2.RegisterSystemMemoryRequest(
            name=name, key=key, offset=offset, byte_size=byte_size), timeout)

    def unregister_system_memory(self, name: str = "", timeout: Optional[float] = None) -> None:
        """Unregisters `name` ("" = every system-memory region)."""
        self._unary(self._stub.UnregisterSystemMemory,
                    memory_pb2.UnregisterSystemMemoryRequest(name=name), timeout)

    def system_memory_status(self, name: str = "", timeout: Optional[float] = None
                             ) -> List[memory_pb2.SystemMemoryStatusResponse.Region]:
        return list(self._unary(self._stub.SystemMemoryStatus,
                                memory_pb2.SystemMemoryStatusRequest(name=name), timeout).regions)

    def register_cuda_memory(self, name: str, raw_handle: bytes, device_id: int, byte_size: int,
                             timeout: Optional[float] = None) -> None:
        """Registers a CUDA allocation of another process by its cudaIpcMemHandle_t (64 bytes)
        on `device_id` as the server sees it; RegionRefs then name it like a system region.
        The region is the whole allocation from its base (the handle names the allocation, not
        the exported pointer): `byte_size` and RegionRef offsets count from the base, so a
        tensor from PyTorch's caching allocator is at offset `t.data_ptr()` minus the base that
        cuMemGetAddressRange(t.data_ptr()) reports.
        Needs a kvtd with CUDA on the same node (FAILED_PRECONDITION without CUDA, UNAVAILABLE
        without a device) and shared memory allowed; admin role under auth."""
        self._unary(self._stub.RegisterCudaMemory, memory_pb2.RegisterCudaMemoryRequest(
            name=name, raw_handle=raw_handle, device_id=device_id, byte_size=byte_size), timeout)

    def unregister_cuda_memory(self, name: str = "", timeout: Optional[float] = None) -> None:
        """Unregisters `name` ("" = every CUDA region)."""
        self._unary(self._stub.UnregisterCudaMemory,
                    memory_pb2.UnregisterCudaMemoryRequest(name=name), timeout)

    def cuda_memory_status(self, name: str = "", timeout: Optional[float] = None
                           ) -> List[memory_pb2.CudaMemoryStatusResponse.Region]:
        return list(self._unary(self._stub.CudaMemoryStatus,
                                memory_pb2.CudaMemoryStatusRequest(name=name), timeout).regions)

    def create_region(self, byte_size: int, name: Optional[str] = None,
                      timeout: Optional[float] = None) -> SharedMemoryRegion:
        """A new SharedMemoryRegion of `byte_size` bytes registered with this server."""
        return SharedMemoryRegion(self, byte_size, name=name, timeout=timeout)


def _combine(parts: List[TranslateResult]) -> TranslateResult:
    """One result of consecutive token ranges translated as separate requests."""
    header = translate_pb2.TranslateResponseHeader()
    header.CopyFrom(parts[0].header)
    header.num_tokens = sum(p.header.num_tokens for p in parts)
    trailer = translate_pb2.TranslateTrailer()
    trailer.CopyFrom(parts[-1].trailer)
    trailer.request_id = parts[0].trailer.request_id
    for name in ("num_tokens", "input_bytes", "output_bytes"):
        setattr(trailer, name, sum(getattr(p.trailer, name) for p in parts))
    for name in ("queue_ms", "stage_in_ms", "compute_ms", "stage_out_ms", "total_ms"):
        setattr(trailer.timings, name, sum(getattr(p.trailer.timings, name) for p in parts))
    trailer.timings.first_output_ms = parts[0].trailer.timings.first_output_ms
    # Per-request figures that do not add up: no speedup estimate, the worst input shift.
    trailer.speedup_estimate = 0.0
    shifts = [p.trailer.input_shift_score for p in parts
              if p.trailer.HasField("input_shift_score")]
    if shifts:
        trailer.input_shift_score = max(shifts)
    targets = [p.target for p in parts if p.target is not None]
    return TranslateResult(header=header, trailer=trailer, target=KVCache.concat(targets),
                           parts=parts)
