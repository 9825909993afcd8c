"""A second "node" for the cluster-tier tests: a process of its own that shares no memory with
the writer. It reads a JSON job from argv[1], finds the longest prefix in Mooncake Store, fetches
it, and writes what it got to job["out"]:

  mode "fetch": the fetched bytes (packed region format), and a JSON line with the match.
  mode "kvtd":  the fetched prefix goes into a kvt.shm.SharedMemoryRegion registered with this
                node's kvtd, is published from it (PrefixCache.publish_region), then looked up
                for job["target"] and translated (translate_cached): the target cache's K and V
                per layer go to an .npz file.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np

from kvt.cluster import ClusterError, ClusterStore, Geometry, StoreConfig, loopback_environment


def main() -> int:
    job = json.loads(sys.argv[1])
    loopback_environment()
    geometry = Geometry(**job["geometry"])
    tokens = job["tokens"]
    store = ClusterStore(StoreConfig(**job["store"]))
    report = {}
    try:
        started = time.monotonic()
        match = store.longest_prefix([geometry], tokens, max_tokens=job.get("max_tokens", 0))[
            geometry.model]
        report.update(blocks=match.blocks, tokens=match.tokens,
                      objects=[[k, s, e] for k, s, e in match.objects],
                      lookup_ms=(time.monotonic() - started) * 1e3)
        if job["mode"] == "fetch":
            buffer = np.zeros(max(1, match.nbytes), np.uint8)
            address, _ = store.register(buffer)
            try:
                store.fetch(match, buffer)
            except ClusterError as error:
                report.update(reason=error.reason, detail=error.detail)
            else:
                with open(job["out"], "wb") as f:
                    f.write(buffer[:match.nbytes].tobytes())
            store.unregister(address)
        else:
            import kvt
            from kvt.cache import DTYPE_NAMES
            from kvt.prefix import PrefixCache
            from kvt.shm import SharedMemoryRegion

            with kvt.Client(job["kvtd"], timeout=30) as client:
                prefix = PrefixCache(client)
                with SharedMemoryRegion(client, match.nbytes) as region:
                    address, _ = store.register(region.buf)
                    started = time.monotonic()
                    store.fetch(match, region.buf)
                    report["fetch_ms"] = (time.monotonic() - started) * 1e3
                    store.unregister(address)
                    # kvtd copies the region into its tier before answering.
                    published = prefix.publish_region(
                        geometry.model, tokens[:match.tokens], region.ref(0, match.nbytes),
                        num_layers=geometry.num_layers, num_kv_heads=geometry.num_kv_heads,
                        head_dim=geometry.head_dim, dtype=geometry.dtype)
                    report["stored_tokens"] = published.stored_tokens
                hit = prefix.lookup(job["target"], tokens, max_tokens=len(tokens) - 1)
                report.update(hit=hit.hit, miss_reason=hit.miss_reason,
                              matched_tokens=hit.matched_tokens, gate=hit.gate.passed)
                if hit.hit:
                    result = client.translate_cached(hit.lease_id, hit.mapper_id,
                                                     hit.matched_tokens,
                                                     dtype=DTYPE_NAMES[hit.dtype],
                                                     output_dtype="fp32")
                    target = result.target.to_layout("NHD")
                    np.savez(job["out"], k=np.stack([np.asarray(k) for k in target.k]),
                             v=np.stack([np.asarray(v) for v in target.v]))
    finally:
        store.close()
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
