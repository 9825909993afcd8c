#!/usr/bin/env python3
"""How far back each member's context helps on held-out text (eval/tinyfamily/README.md,
"Context"): the same bytes scored after a long context ending at position P and after only the
64 bytes before them. Where the long context scores worse than the short one, the member has
stopped using its positions; its declared context (config.json max_position_embeddings) ends
before that.

    .venv/bin/python eval/tinyfamily/position_curve.py [--windows=32] [--ends=320,512,640,1024,2048]
"""

import argparse
import os

import numpy as np
import torch
import torch.nn.functional as F
from transformers import LlamaForCausalLM

import corpus

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = os.path.join(HERE, "models")
SPAN = 64   # bytes scored
SHORT = 64  # the short context before them


def heldout_stream():
    """The held-out documents' bytes joined with EOS (0), as uint8."""
    docs = corpus.splits()["heldout"]
    return np.frombuffer(b"\0".join(d["text"].encode() for d in docs), dtype=np.uint8)


def span_nll(model, ids):
    """Mean cross-entropy (nats) of the last SPAN bytes of `ids` given everything before them."""
    x = torch.tensor(ids.astype(np.int64))[None]
    with torch.no_grad():
        logits = model(x).logits[0, -SPAN - 1:-1]
    return float(F.cross_entropy(logits, x[0, -SPAN:]).item())


def long_vs_short(member_dir, stream, windows, end):
    """(long, short): mean cross-entropy of bytes [end - SPAN, end) of `windows` windows spread
    evenly over `stream`, after the whole window before them (positions 0..end-SPAN-1) and after
    only the SHORT bytes before them."""
    model = LlamaForCausalLM.from_pretrained(member_dir, dtype=torch.float32).eval()
    starts = np.linspace(0, len(stream) - end - 1, windows).astype(int)
    long = [span_nll(model, stream[s:s + end]) for s in starts]
    short = [span_nll(model, stream[s + end - SPAN - SHORT:s + end]) for s in starts]
    return float(np.mean(long)), float(np.mean(short))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--windows", type=int, default=32)
    p.add_argument("--ends", default="320,512,640,1024,2048")
    p.add_argument("--members", default="S,M,U,L")
    args = p.parse_args()
    torch.set_num_threads(os.cpu_count() or 1)
    stream = heldout_stream()
    ends = [int(e) for e in args.ends.split(",")]
    print("Long-context minus short-context cross-entropy (nats/byte) of the 64 bytes ending at "
          f"position P, {args.windows} held-out windows; negative: the long context helps.\n")
    print("| member | " + " | ".join(f"P = {e}" for e in ends) + " |")
    print("|---|" + "---:|" * len(ends))
    for m in args.members.split(","):
        cells = []
        for e in ends:
            long, short = long_vs_short(os.path.join(MODELS, m), stream, args.windows, e)
            cells.append(f"{long - short:+.3f} ({long:.3f} vs {short:.3f})")
        print(f"| {m} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
