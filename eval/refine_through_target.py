#!/usr/bin/env python3
"""Experiment: refine a ridge mapper through the frozen target, on its next-token distribution.

    bazel build //eval:refine_through_target && PATH=$PWD/.venv/bin:$PATH \
        bazel-bin/eval/refine_through_target --store=/tmp/kvt-eval/store --pair=M:S

A variant of `kvt fit --refine=attention` with the target model in the loop: the loss is KL(own
|| mapped) of the target's next-token distribution on the tokens after a seeded handoff boundary
(the tokens before it read the translated cache, those after it are the target's own forward
pass, as in a handoff), back-propagated through the frozen target (transformers, float32) into
the served ridge's weights (SPEC 3, read from the store; Adam). `kvt fit` cannot do this: it has
the dumps, not the target model. Reports, before and after (weights rounded to bf16 as served):
the loss on held-out calibration windows, and on docs/EVAL.md's 16 held-out windows the KL to
the target's own distribution and the context benefit recovered. Nothing is written to the
store.
"""

import argparse
import json
import os

import numpy as np
import torch
import yaml
from safetensors.torch import load_file

from kvt import adapters
import intervals
import retention as R


class TorchRidge:
    """A ridge mapper's SPEC 3 apply in torch, differentiable in its weights (float32)."""

    def __init__(self, directory, source, target):
        with open(os.path.join(directory, "manifest.yaml")) as f:
            self.manifest = yaml.safe_load(f)
        assert self.manifest["kind"] == "ridge", self.manifest["kind"]
        weights = load_file(os.path.join(directory, self.manifest["weights"]["file"]))
        self.params = {k: torch.nn.Parameter(v.float()) for k, v in weights.items()}
        self.source, self.target = source, target

    def features(self, ids):
        """The source's cache of ids, keys RoPE-stripped (content space), no gradient."""
        with torch.no_grad():
            cache = self.source.prefill(ids)
        return [(self.source.rope(k, 0, inverse=True), v) for k, v in cache]

    def apply(self, features, tokens, weights=None):
        """The target cache (per layer K with target RoPE, V) of the first `tokens` tokens."""
        w = weights or self.params
        out = []
        for entry in self.manifest["layers"]:
            l = entry["target_layer"]

            def x(kind, sigma):
                return torch.cat([features[j][kind][0, :, :tokens].transpose(0, 1)
                                  .reshape(tokens, -1) for j in sigma], 1)

            def heads(y):
                return y.reshape(tokens, self.target.n_kv, -1).transpose(0, 1)[None]
            k = heads(x(0, entry["sigma_k"]) @ w[f"layers.{l}.k.weight"] +
                      w[f"layers.{l}.k.bias"])
            v = heads(x(1, entry["sigma_v"]) @ w[f"layers.{l}.v.weight"] +
                      w[f"layers.{l}.v.bias"])
            out.append((self.target.rope(k, 0), v))
        return out

    def served(self):
        """The weights rounded to bf16, as `kvt fit` stores them."""
        return {k: v.detach().to(torch.bfloat16).float() for k, v in self.params.items()}


def handoff_logprobs(target, cache, ids):
    """The target's next-token log-probabilities over ids, read on top of `cache` (graph kept,
    so that gradients reach the cache)."""
    dynamic = adapters.as_dynamic_cache(tuple(cache))  # the tensors themselves
    logits = target.hf(input_ids=torch.tensor([ids]), past_key_values=dynamic,
                       use_cache=True).logits[0]
    return torch.log_softmax(logits.double(), -1)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--family", default=R.MODELS)
    p.add_argument("--store", required=True, help="a mapper store with {A}-to-{B}-k{k}")
    p.add_argument("--pair", default="M:S")
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--calib_windows", type=int, default=64)
    p.add_argument("--calib_tokens", type=int, default=512)
    p.add_argument("--heldout", type=int, default=6, help="calibration windows held out")
    p.add_argument("--windows", type=int, default=16)
    p.add_argument("--context", type=int, default=384)
    p.add_argument("--continuation", type=int, default=96)
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    caller = os.environ.get("BUILD_WORKSPACE_DIRECTORY", os.getcwd())
    torch.set_num_threads(1)
    a, b = args.pair.split(":")
    source = R.Member(os.path.join(args.family, a))
    target = R.Member(os.path.join(args.family, b))
    for w in target.hf.parameters():
        w.requires_grad_(False)
    mapper = TorchRidge(os.path.join(caller, args.store, f"{a}-to-{b}-k{args.k}"), source,
                        target)
    start = mapper.served()
    calib = R.calib_windows(args.calib_tokens, args.calib_windows)
    prepared = []
    for ids in calib:
        with torch.no_grad():
            own = torch.log_softmax(target.hf(input_ids=torch.tensor([ids])).logits[0].double(),
                                    -1)
        prepared.append((ids, mapper.features(ids), own))
    train, held = prepared[:-args.heldout], prepared[-args.heldout:]

    def loss(item, boundary, weights=None):
        ids, features, own = item
        mapped = handoff_logprobs(target, mapper.apply(features, boundary, weights),
                                  ids[boundary:])
        return R.kl_of(own[boundary:], mapped).mean()

    def heldout_loss(weights):
        bounds = [args.calib_tokens * f // 8 for f in (5, 6, 7)]
        with torch.no_grad():
            return float(np.mean([float(loss(item, t, weights)) for item in held
                                  for t in bounds]))

    windows = R.heldout_windows(args.context + args.continuation + 1, args.windows)
    c = args.context

    def on_windows(weights):
        """(KL to own, benefit recovered) on the evaluation's held-out windows."""
        kls, ce = [], {"own": [], "none": [], "mapped": []}
        with torch.no_grad():
            for w in windows:
                cont, tgt = w[c:-1], w[c + 1:]
                own = target.continuation_logprobs(target.prefill(w[:c]), cont)
                mapped = handoff_logprobs(target, mapper.apply(mapper.features(w[:c]), c,
                                                               weights), cont)
                kls.append(float(R.kl_of(own, mapped).mean()))
                ce["own"].append(np.mean(R.nll_of(own, tgt)))
                ce["mapped"].append(np.mean(R.nll_of(mapped, tgt)))
                ce["none"].append(np.mean(target.continuation_nll(None, cont, tgt)))
        m = {key: np.mean(v) for key, v in ce.items()}
        return float(np.mean(kls)), float(intervals.benefit_of(m, "mapped"))

    before = {"heldout_kl": heldout_loss(start), "window": on_windows(start)}
    opt = torch.optim.Adam(mapper.params.values(), args.lr)
    rng = np.random.default_rng(args.seed)
    T = args.calib_tokens
    for step in range(args.steps):
        total = sum(loss(train[int(i)], int(rng.integers(T // 4, T - T // 8)))
                    for i in rng.choice(len(train), args.batch)) / args.batch
        opt.zero_grad()
        total.backward()
        opt.step()
    after_weights = mapper.served()
    after = {"heldout_kl": heldout_loss(after_weights), "window": on_windows(after_weights)}
    report = {"pair": args.pair, "steps": args.steps, "lr": args.lr, "batch": args.batch}
    for name, r in (("before", before), ("after", after)):
        report[name] = {"heldout_calibration_kl": round(r["heldout_kl"], 4),
                        "window_kl": round(r["window"][0], 4),
                        "window_benefit": round(r["window"][1], 4)}
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
