#!/usr/bin/env python3
"""Latency and throughput of kvt.Client translations against a running kvtd: inline chunked
streaming vs a shared-memory region, for several token counts (random bf16/fp16/fp32 caches of
the mapper's source shape). Prints a markdown table; --json_out writes the raw numbers.

Rows: `inline` (the cache streamed in chunks, the result streamed back); `shm` (one region per
token count, created and registered once before the timed loop: each timed call packs the
source into it, translates in place and reads the result back out, i.e. transport + translate
only); `shm_per_call` (translate_via_shm: the same plus creating, registering, unregistering
and unlinking a temporary region every call; --no_shm_per_call skips it).

    kvtd --mapper_store=demo/mappers --backend=cpu --config=<yaml with
         shared_memory.allow_client_regions: true> &
    PYTHONPATH=clients/python python3 clients/python/benchmarks/translate_bench.py \\
        --server=127.0.0.1:50051 --mapper=demo-tiny --tokens=512,4096,16384 --repeats=20
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any, Callable, Dict, List

import numpy as np

import kvt
from kvt.cache import ELEMENT_SIZE
from kvt.shm import SharedMemoryRegion


def measure(call: Callable[[], Any], repeats: int) -> List[float]:
    call()  # warm-up: mapper page-in, connection
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append((time.perf_counter() - start) * 1e3)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--server", default="127.0.0.1:50051")
    parser.add_argument("--mapper", default="demo-tiny")
    parser.add_argument("--tokens", default="512,4096,16384")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--no_shm", action="store_true", help="skip the shared-memory rows")
    parser.add_argument("--no_shm_per_call", action="store_true",
                        help="skip the translate_via_shm row (a new region every call)")
    parser.add_argument("--json_out", default="")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    rows: List[Dict[str, Any]] = []
    with kvt.Client(args.server, timeout=600) as client:
        info = client.get_mapper(args.mapper)
        shape = info.source_shape
        target_shape = info.target_shape
        print(f"mapper {args.mapper}: {info.source_model} -> {info.target_model}, "
              f"{args.dtype}, {args.repeats} repeats after 1 warm-up\n")
        print("| tokens | transport | p50 ms | p90 ms | server total_ms p50 | MB in+out | GB/s |")
        print("|---:|---|---:|---:|---:|---:|---:|")
        for tokens in (int(t) for t in args.tokens.split(",")):
            arrays = [rng.standard_normal((shape.num_kv_heads, tokens, shape.head_dim),
                                          dtype=np.float32) for _ in range(2 * shape.num_layers)]
            source = kvt.KVCache(k=arrays[:shape.num_layers], v=arrays[shape.num_layers:],
                                 dtype=args.dtype)
            server_ms: List[float] = []
            out_bytes_seen: List[int] = []

            def inline() -> None:
                result = client.translate(source, mapper_id=args.mapper)
                server_ms.append(result.trailer.timings.total_ms)
                out_bytes_seen.append(result.trailer.output_bytes)

            # The region of the `shm` row: set up once, outside the timed calls (a client
            # that translates repeatedly keeps its regions registered).
            in_bytes = source.nbytes
            out_offset = (in_bytes + 63) // 64 * 64
            out_bytes = (2 * target_shape.num_layers * target_shape.num_kv_heads *
                         target_shape.head_dim * tokens * ELEMENT_SIZE[args.dtype])
            region = None if args.no_shm else SharedMemoryRegion(client, out_offset + out_bytes)

            def shm() -> None:
                assert region is not None
                region.write_cache(source, offset=0)
                result = client.translate_regions(
                    input_region=region.name, output_region=region.name, num_tokens=tokens,
                    dtype=args.dtype, input_byte_size=in_bytes, output_byte_size=out_bytes,
                    output_offset=out_offset, layout=source.layout, mapper_id=args.mapper)
                result.target = region.read_cache(
                    out_offset, target_shape.num_layers, target_shape.num_kv_heads,
                    target_shape.head_dim, tokens, args.dtype, source.layout)
                server_ms.append(result.trailer.timings.total_ms)
                out_bytes_seen.append(result.trailer.output_bytes)

            def shm_per_call() -> None:
                result = client.translate_via_shm(source, mapper_id=args.mapper)
                server_ms.append(result.trailer.timings.total_ms)
                out_bytes_seen.append(result.trailer.output_bytes)

            try:
                for name, call in (("inline", inline), ("shm", shm),
                                   ("shm_per_call", shm_per_call)):
                    if name != "inline" and args.no_shm:
                        continue
                    if name == "shm_per_call" and args.no_shm_per_call:
                        continue
                    server_ms.clear()
                    times = measure(call, args.repeats)
                    moved = source.nbytes + out_bytes_seen[-1]
                    p50 = statistics.median(times)
                    p90 = sorted(times)[max(0, int(0.9 * len(times)) - 1)]
                    row = {"tokens": tokens, "transport": name, "p50_ms": p50, "p90_ms": p90,
                           "server_total_ms_p50": statistics.median(server_ms[1:]),
                           "bytes": moved, "gb_per_s": moved / (p50 * 1e-3) / 1e9}
                    rows.append(row)
                    print(f"| {tokens} | {name} | {p50:.2f} | {p90:.2f} | "
                          f"{row['server_total_ms_p50']:.2f} | {moved / 1e6:.1f} | "
                          f"{row['gb_per_s']:.2f} |", flush=True)
            finally:
                if region is not None:
                    region.close()
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
