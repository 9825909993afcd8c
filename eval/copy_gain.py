#!/usr/bin/env python3
"""How much each family member gains from context far back (the gate for retraining: 1 nat/byte).

    bazel build //eval:copy_gain && PATH=$PWD/.venv/bin:$PATH bazel-bin/eval/copy_gain

Per member: the mean nats/byte an earlier copy of a passage (--context - --continuation - 1
bytes back) saves on the passage's second copy, against the same window with other text in the
copy's place (retention.copy_windows, copy_gain). A model that can copy (induction) gains
several nats there; the retrained family must gain >= 1 before the long-range windows of the
evaluation can discriminate a translated cache from token identity.
"""

import argparse
import json
import os

import torch

import retention as R


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--family", default=R.MODELS)
    p.add_argument("--members", default="S,M,L,U")
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--context", type=int, default=352)
    p.add_argument("--continuation", type=int, default=95)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    windows, controls = R.copy_windows(args.context, args.continuation, args.windows, args.seed)
    gains = {}
    for m in args.members.split(","):
        member = R.Member(os.path.join(args.family, m))
        gains[m] = round(R.copy_gain(member, windows, controls, args.context), 4)
        print(f"{m}: {gains[m]:+.4f} nats/byte from a copy "
              f"{args.context - args.continuation - 1} bytes back", flush=True)
    print(json.dumps({"copy_gain_nats_per_byte": gains, "windows": args.windows,
                      "context": args.context, "continuation": args.continuation}))


if __name__ == "__main__":
    main()
