#!/usr/bin/env python3
"""A handoff between two bundled family members through kvtd (the quick start's second part).

kvt-tiny-M reads a held-out passage; kvtd translates its KV cache into kvt-tiny-L's (mapper fitted
here with `kvt fit` on the calibration documents); L continues from the translated cache. Prints
the translation latency (gRPC round trip), L's own prefill time of the same context on this
machine, and the context benefit recovered on the continuation.

    bazel build //eval:handoff_demo
    PATH=$PWD/.venv/bin:$PATH bazel-bin/eval/handoff_demo
"""

import os
import tempfile
import time

import torch

import kvt
import retention as R

CONTEXT, CONTINUATION, WINDOWS = 384, 96, 8


def main():
    torch.set_num_threads(1)
    family = R.MODELS
    source, target = R.Member(os.path.join(family, "M")), R.Member(os.path.join(family, "L"))
    work = tempfile.mkdtemp(prefix="kvt-handoff-")
    calib = R.write_split("calib", os.path.join(work, "calib.jsonl"))
    # The target's queries too: kvt fit records the mapper's held-out attention-output cosine.
    dumps = [R.dump(m.dir, calib, os.path.join(work, n), 512, 32, queries=n == "L")
             for n, m in (("M", source), ("L", target))]
    store = os.path.join(work, "store")
    R.fit(dumps[0], dumps[1], source.name, target.name, 2, os.path.join(store, "M-to-L"))
    windows = R.heldout_windows(CONTEXT + CONTINUATION + 1, WINDOWS)
    nll = {"own": [], "none": [], "mapped": []}
    translate_ms, prefill_ms = [], []
    with R.start_kvtd(store) as server, kvt.Client(server.address, timeout=60) as client:
        for ids in windows:
            ctx, cont, tgt = ids[:CONTEXT], ids[CONTEXT:-1], ids[CONTEXT + 1:]
            src = source.prefill(ctx)
            t0 = time.perf_counter()
            mapped = R.translate(client, "M-to-L", src)
            translate_ms.append((time.perf_counter() - t0) * 1e3)
            t0 = time.perf_counter()
            own = target.prefill(ctx)
            prefill_ms.append((time.perf_counter() - t0) * 1e3)
            nll["own"].append(target.continuation_nll(own, cont, tgt))
            nll["none"].append(target.continuation_nll(None, cont, tgt))
            nll["mapped"].append(target.continuation_nll(mapped, cont, tgt))
    ce = R.summarize(nll)
    tr, pf = sorted(translate_ms)[len(windows) // 2], sorted(prefill_ms)[len(windows) // 2]
    print(f"handoff {source.name} -> {target.name} through kvtd ({WINDOWS} held-out passages, "
          f"{CONTEXT}-byte context):")
    print(f"  translate (gRPC, median): {tr:.1f} ms; {target.name} own prefill (median): "
          f"{pf:.1f} ms; speedup {pf / tr:.2f}x")
    print(f"  CE on the next {CONTINUATION} bytes (nats/byte): own {ce['own']['all']:.3f}, "
          f"translated {ce['mapped']['all']:.3f}, no context {ce['none']['all']:.3f}")
    print(f"  context benefit recovered: {R.benefit(ce, 'mapped'):.2f} "
          f"(first {R.FIRST} bytes: {R.benefit(ce, 'mapped', 'first'):.2f})")


if __name__ == "__main__":
    main()
