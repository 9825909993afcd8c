"""One translated load on the worker: TranslateKV of a leased prefix into a request's blocks,
in place (kvtd writes the engine's shared cache), through the load region (kvtd writes a packed
region, the worker copies each layer as it lands) or inline (chunks through gRPC)."""

from __future__ import annotations

import time
from typing import Any, Callable, Optional, Tuple

import numpy as np

from kvt.vllm.engine_kv import ELEMENT_BYTES, WIRE_NUMPY, RowWriter
from kvt.vllm.metadata import LoadResult, LoadSpec
from kvt.vllm.regions import describe_error


class TranslatedLoad:
    """Runs on a load thread of the worker (`worker`: a KvtWorker, read-only here)."""

    def __init__(self, worker: Any, spec: LoadSpec) -> None:
        self.w = worker
        self.spec = spec
        self.rows = RowWriter(worker.kv, spec.block_ids, spec.start, spec.end)

    def run(self) -> LoadResult:
        t0 = time.monotonic()
        try:
            result = self._translate()
        except Exception as error:
            result = LoadResult(ok=False, error=describe_error(error))
        result.translate_ms = round((time.monotonic() - t0) * 1e3, 3)
        return result

    def _translate(self) -> LoadResult:
        spec, w = self.spec, self.w
        holder = w.engine_region if spec.load == "auto" else None
        engine = holder.get(0) if holder is not None else None
        if holder is not None and engine is not None:
            try:
                return self._translate_in_place(engine)
            except BaseException:
                holder.mark_failed()
                raise
        nbytes = w.kv.cache_bytes(spec.matched_tokens)
        holder = w.load_region if spec.load != "inline" else None
        region = holder.acquire(nbytes) if holder is not None else None
        if holder is None or region is None:
            return self._translate_inline()
        failed = True
        try:
            result = self._translate_region(region, nbytes)
            failed = False
            return result
        finally:
            holder.release(failed)

    def _header(self) -> Any:
        from kvt.prefix import cached_translate_header
        spec = self.spec
        return cached_translate_header(spec.lease_id, spec.mapper_id, spec.matched_tokens,
                                       dtype=spec.dtype, output_dtype=self.w.kv.dtype,
                                       output_layout="NHD", request_id=f"{spec.req_id}/load")

    def _check_target_header(self, header: Any, call: Any) -> str:
        """The response header's shape, layout and dtype against this engine's cache (the call
        cancelled and an error raised on a mismatch); returns the wire dtype of the rows."""
        from kvt._proto import common_pb2
        from kvt.cache import DTYPE_NAMES
        kv = self.w.kv
        shape, dtype = header.target_shape, DTYPE_NAMES.get(header.output_dtype)
        mine = (kv.num_layers, kv.num_kv_heads, kv.head_dim)
        problem = None
        if (shape.num_layers, shape.num_kv_heads, shape.head_dim) != mine:
            problem = (f"mapper {self.spec.mapper_id} produces {shape.num_layers}x"
                       f"{shape.num_kv_heads}x{shape.head_dim}, this engine's cache is "
                       f"{mine[0]}x{mine[1]}x{mine[2]}")
        elif header.output_layout != common_pb2.LAYOUT_NHD:
            problem = "kvtd answered a layout other than NHD"
        elif dtype is None or dtype not in WIRE_NUMPY:
            problem = f"kvtd answered output dtype {header.output_dtype}"
        if problem or dtype is None:
            call.cancel()
            raise RuntimeError(problem)
        return dtype

    def _region_call(self, header: Any, on_layer: Optional[Callable[[int, int], None]]
                     ) -> Tuple[Any, Any]:
        """Runs TranslateKV for `header` (output in a region, no chunks to send) and returns
        (response header, trailer); `on_layer(layer, kind)` for each layer notice."""
        import grpc
        from kvt._proto import translate_pb2
        from kvt.errors import from_rpc_error
        w = self.w
        client, _ = w.kvt()
        # wait_for_ready: the scheduler's lookup just got the lease, so kvtd is up; this
        # process's channel may still be reconnecting (e.g. after a kvtd restart).
        call = client.stub.TranslateKV(
            iter([translate_pb2.TranslateKVRequest(header=header)]),
            timeout=w.config.translate_timeout_s, metadata=client._metadata,
            wait_for_ready=True)
        response_header = trailer = None
        try:
            for response in call:
                which = response.WhichOneof("msg")
                if which == "header":
                    response_header = response.header
                    self._check_region_header(response_header, call)
                elif which == "chunk":
                    self._on_notice(response.chunk, response_header, on_layer, call)
                elif which == "trailer":
                    trailer = response.trailer
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None
        if response_header is None or trailer is None:
            raise RuntimeError("kvtd ended the stream without a header and trailer")
        return response_header, trailer

    def _check_region_header(self, header: Any, call: Any) -> None:
        from kvt.cache import DTYPE_NAMES
        if self._check_target_header(header, call) != self.w.kv.dtype:
            call.cancel()
            raise RuntimeError(f"kvtd wrote {DTYPE_NAMES.get(header.output_dtype)} into the "
                               f"region; this engine's cache is {self.w.kv.dtype}")

    def _on_notice(self, notice: Any, header: Any,
                   on_layer: Optional[Callable[[int, int], None]], call: Any) -> None:
        from kvt._proto import common_pb2
        if (header is None or on_layer is None or notice.layer >= self.w.kv.num_layers
                or notice.data or notice.token_start != 0
                or notice.token_count != self.spec.matched_tokens):
            call.cancel()
            raise RuntimeError(f"unexpected region notice {notice.layer}/{notice.kind} "
                               f"[{notice.token_start}, +{notice.token_count})")
        on_layer(notice.layer, 0 if notice.kind == common_pb2.CACHE_KIND_K else 1)

    @staticmethod
    def _result(transport: str, load_s: float, trailer: Any) -> LoadResult:
        return LoadResult(
            ok=True, transport=transport, load_ms=round(load_s * 1e3, 3),
            kvtd_total_ms=round(trailer.timings.total_ms, 3),
            kvtd_compute_ms=round(trailer.timings.compute_ms, 3),
            input_shift_score=(trailer.input_shift_score
                               if trailer.HasField("input_shift_score") else None))

    def _translate_in_place(self, engine: Any) -> LoadResult:
        """kvtd writes the request's tokens [start, end) straight into its blocks of the
        engine's shared cache, in the kernels' order: nothing to copy here."""
        spec, w = self.spec, self.w
        header = self._header()
        ref = header.output.region
        ref.region, ref.offset, ref.byte_size = engine.name, 0, engine.byte_size
        w.fill_paged_ref(ref.paged, spec.block_ids, spec.start, spec.end, output=True)
        _, trailer = self._region_call(header, None)
        return self._result("in_place", 0.0, trailer)

    def _translate_region(self, region: Any, nbytes: int) -> LoadResult:
        """kvtd writes the result into the load region (packed: per layer K then V,
        [tokens, heads, head_dim]); each layer is copied into the blocks as soon as kvtd says
        it is there (header.region_layer_notices), while kvtd computes the next ones."""
        spec, kv = self.spec, self.w.kv
        start, end, matched = spec.start, spec.end, spec.matched_tokens
        header = self._header()
        header.output.region.CopyFrom(region.ref(0, nbytes))
        header.region_layer_notices = self.w.config.layer_notices
        packed = np.frombuffer(region.buf, dtype=WIRE_NUMPY[kv.dtype],
                               count=nbytes // ELEMENT_BYTES[kv.dtype]).reshape(
                                   kv.num_layers, 2, matched, kv.num_kv_heads, kv.head_dim)
        loaded = np.zeros((kv.num_layers, 2), dtype=bool)
        load_s = 0.0

        def load(layer: int, kind: int) -> None:
            nonlocal load_s
            t = time.monotonic()
            self.rows.write(layer, kind == 0, start, packed[layer, kind, start:end], kv.dtype)
            loaded[layer, kind] = True
            load_s += time.monotonic() - t

        _, trailer = self._region_call(header, load)
        # A kvtd without notices wrote everything by the trailer.
        for layer, kind in zip(*np.nonzero(~loaded)):
            load(int(layer), int(kind))
        return self._result("shm", load_s, trailer)

    def _translate_inline(self) -> LoadResult:
        from kvt._proto import common_pb2
        spec, w = self.spec, self.w
        kv = w.kv
        _, prefix = w.kvt()
        start, end = spec.start, spec.end
        stream = prefix.translate_cached_stream(
            spec.lease_id, spec.mapper_id, spec.matched_tokens, dtype=spec.dtype,
            output_dtype=kv.dtype, output_layout="NHD", request_id=f"{spec.req_id}/load",
            timeout=w.config.translate_timeout_s, wait_for_ready=True)
        covered = np.zeros((kv.num_layers, 2, end - start), dtype=bool)
        header = trailer = None
        load_s = 0.0
        out_dtype = "fp32"
        for which, message in stream:
            if which == "header":
                header = message
                out_dtype = self._check_target_header(header, stream)
            elif which == "chunk":
                if header is None:
                    raise RuntimeError("a target chunk before the response header")
                chunk = message
                if chunk.layer >= kv.num_layers:
                    raise RuntimeError(f"target chunk of layer {chunk.layer}")
                lo = max(chunk.token_start, start)
                hi = min(chunk.token_start + chunk.token_count, end)
                if hi <= lo:
                    continue
                t = time.monotonic()
                is_k = chunk.kind == common_pb2.CACHE_KIND_K
                rows = np.frombuffer(chunk.data, dtype=WIRE_NUMPY[out_dtype]).reshape(
                    chunk.token_count, kv.num_kv_heads, kv.head_dim)[
                        lo - chunk.token_start:hi - chunk.token_start]
                self.rows.write(chunk.layer, is_k, lo, rows, out_dtype)
                covered[chunk.layer, 0 if is_k else 1, lo - start:hi - start] = True
                load_s += time.monotonic() - t
            elif which == "trailer":
                trailer = message
        if header is None or trailer is None:
            raise RuntimeError("kvtd ended the stream without a header and trailer")
        if not covered.all():
            raise RuntimeError(f"kvtd's result misses {int((~covered).sum())} token rows")
        return self._result("inline", load_s, trailer)
