"""A test double of kvtd's source-cache tier for the connector's mechanics test: Publish stores the
cache, LookupPrefix offers the longest stored prefix of the *same* model (identity "mapper"
`self`), TranslateKV on the lease streams it back unchanged. An engine that reuses its own
published KV through it must produce exactly the tokens of a plain run, which checks the paged
gather / scatter, the asynchronous load and the outcome plumbing independently of any mapper's
quality. The real kvtd (//server:kvtd) runs every other test.

    python3 fake_kvtd.py --port_file=PATH   (writes the port it listens on)
"""

import argparse
import os
import threading
import time
import uuid
from concurrent import futures

import grpc

from kvt._proto import (common_pb2, prefix_cache_pb2, prefix_cache_pb2_grpc, service_pb2_grpc,
                        translate_pb2)

BLOCK = 16


class State:
    def __init__(self):
        self.lock = threading.Lock()
        self.entries = []  # (model, tokens, dtype, shape, {(layer, kind): bytes rows})
        self.leases = {}
        self.lookups = 0
        self.delay_s = 0.0     # LookupPrefix sleeps this long
        self.publish_delay_s = 0.0  # Publish sleeps this long (a stuck kvtd)
        self.mode = "exact"    # TranslateKV: "exact", "zero_v" (V rows zeroed), "fail_midway"


class PrefixCache(prefix_cache_pb2_grpc.KvPrefixCacheServicer):
    def __init__(self, state):
        self.s = state

    def Publish(self, request_iterator, context):
        if self.s.publish_delay_s:
            time.sleep(self.s.publish_delay_s)
        header = None
        rows = {}
        for req in request_iterator:
            if req.WhichOneof("msg") == "header":
                header = req.header
                continue
            c = req.chunk
            width = len(c.data) // c.token_count
            buf = rows.setdefault((c.layer, c.kind), bytearray(width * len(header.token_ids)))
            buf[c.token_start * width:(c.token_start + c.token_count) * width] = c.data
        n = len(header.token_ids) // BLOCK * BLOCK
        with self.s.lock:
            self.s.entries.append((header.model, list(header.token_ids[:n]), header.dtype,
                                   header.shape, rows))
        return prefix_cache_pb2.PublishResponse(request_id=header.request_id, stored_tokens=n,
                                                new_blocks=n // BLOCK, block_tokens=BLOCK)

    def LookupPrefix(self, request, context):
        with self.s.lock:
            self.s.lookups += 1
            delay = self.s.delay_s
        if delay:
            time.sleep(delay)
        if request.policy == prefix_cache_pb2.REUSE_POLICY_FORBID:
            return prefix_cache_pb2.LookupPrefixResponse(hit=False, miss_reason="forbidden")
        tokens = list(request.token_ids)
        limit = request.max_tokens or len(tokens)
        best = None
        with self.s.lock:
            for entry in self.s.entries:
                model, stored = entry[0], entry[1]
                if model != request.target_model:
                    continue
                m = 0
                while m < min(len(stored), limit) and stored[m] == tokens[m]:
                    m += 1
                m = m // BLOCK * BLOCK
                if m and (best is None or m > best[1]):
                    best = (entry, m)
            if best is None or best[1] < max(request.min_tokens, 1):
                return prefix_cache_pb2.LookupPrefixResponse(hit=False, miss_reason="no_prefix")
            lease = uuid.uuid4().hex
            self.s.leases[lease] = best
        entry, m = best
        return prefix_cache_pb2.LookupPrefixResponse(
            hit=True, source_model=entry[0], mapper_id="self", matched_tokens=m, dtype=entry[2],
            layout=common_pb2.LAYOUT_NHD, lease_id=lease, lease_seconds=30,
            gate=prefix_cache_pb2.GateVerdict(passed=True, mapper_quality=1.0))


class Translator(service_pb2_grpc.KvTranslatorServicer):
    def __init__(self, state):
        self.s = state

    def TranslateKV(self, request_iterator, context):
        header = next(iter(request_iterator)).header
        with self.s.lock:
            lease = self.s.leases.pop(header.input.cached.lease_id, None)
        if lease is None:
            context.abort(grpc.StatusCode.NOT_FOUND, "input.cached.lease_id: unknown lease")
        (model, _, dtype, shape, rows), m = lease
        if header.num_tokens != m:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "num_tokens differs from the lease")
        t0 = time.monotonic()
        yield translate_pb2.TranslateKVResponse(header=translate_pb2.TranslateResponseHeader(
            request_id=header.request_id, mapper_id="self", source_model=model,
            target_model=model, target_shape=shape, output_dtype=dtype,
            output_layout=common_pb2.LAYOUT_NHD, num_tokens=m))
        mode = self.s.mode
        for layer in range(shape.num_layers):
            if mode == "fail_midway" and layer == shape.num_layers // 2:
                context.abort(grpc.StatusCode.INTERNAL, "fake_kvtd: failing mid-stream")
            for kind in (common_pb2.CACHE_KIND_K, common_pb2.CACHE_KIND_V):
                data = bytes(rows[(layer, kind)])
                if mode == "zero_v" and kind == common_pb2.CACHE_KIND_V:
                    data = bytes(len(data))
                width = shape.num_kv_heads * shape.head_dim * (
                    4 if dtype == common_pb2.DTYPE_FP32 else 2)
                yield translate_pb2.TranslateKVResponse(chunk=common_pb2.KVChunk(
                    layer=layer, kind=kind, token_start=0, token_count=m,
                    data=data[:m * width]))
        yield translate_pb2.TranslateKVResponse(trailer=translate_pb2.TranslateTrailer(
            request_id=header.request_id, num_tokens=m,
            timings=translate_pb2.StageTimings(total_ms=(time.monotonic() - t0) * 1e3)))


def serve(port=0):
    state = State()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8),
                         options=[("grpc.max_receive_message_length", 64 << 20),
                                  ("grpc.max_send_message_length", 64 << 20)])
    prefix_cache_pb2_grpc.add_KvPrefixCacheServicer_to_server(PrefixCache(state), server)
    service_pb2_grpc.add_KvTranslatorServicer_to_server(Translator(state), server)
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server, port, state


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port_file", required=True)
    args = parser.parse_args()
    server, port, _ = serve()
    with open(args.port_file + ".tmp", "w") as f:
        f.write(str(port))
    os.rename(args.port_file + ".tmp", args.port_file)
    server.wait_for_termination()
