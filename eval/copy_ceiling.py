#!/usr/bin/env python3
"""What map of the source cache could carry a copy: one target layer's keys, several maps.

    bazel build //eval:copy_ceiling && PATH=$PWD/.venv/bin:$PATH bazel-bin/eval/copy_ceiling \
        --store=/tmp/kvt-eval/store --pair=M:L

The evaluation's layer probe (retention.copy_layer_probe, docs/EVAL.md) finds the target layer
whose own keys restore a translated cache's copy (where the target's induction heads look the
copy up). This tool keeps the served mapper everywhere else and replaces that layer's keys with
the keys of alternative maps, fitted here (float64, centred ridge as SPEC 4.1, lambda 0.01) on
the calibration windows, then reports each one's long-range share on the copy windows (copy
gain over the target's own, as the evaluation computes it):

- served: the store's mapper (`{A}-to-{B}-k{k}`) unchanged;
- ridge, sigma: the served mapper's source layers, refitted here (matches served up to bf16);
- ridge, all layers: every source layer's keys (RoPE stripped) and values;
- ridge, all layers at p..p-w+1: the same features of the w - 1 previous tokens too, which
  SPEC 3's token-wise map cannot see;
- MLP, all layers (and at p..p-w+1, the widest w): two hidden ReLU layers, MSE-trained (Adam);
- own keys: the target's own (the ceiling for this layer).

--values replaces the layer's values too (each map then predicts keys and values; the layer probe
finds the own keys and values restore 0.93-1.00 of a copy, the own keys alone 0.71-0.96). --maps
picks which maps run (their labels' short names: served, ridge_sigma, ridge_all, ridge_window,
mlp_all, mlp_window, own); with --calib_windows and --mlp_steps it measures how the window MLP's
share grows with data and training. Each fitted map's relative MSE on held-out windows (the
eval's held-out split) is printed beside its share. --key_loss=logit trains the MLPs' key
outputs on the attention-logit error they cause under the target's own queries at the layer
(query_metric) instead of their squared error.

A research tool for the long-range mapper work docs/EVAL.md leaves open; nothing here is served.
"""

import argparse
import json
import os

import numpy as np
import torch
import yaml
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import kvt
import retention as R


def source_features(source, ids, layers):
    """Per token, the source's stripped keys then values of `layers`, concatenated."""
    cache = source.prefill(ids)
    keys = [R.token_rows(source.rope(cache[j][0], 0, inverse=True)) for j in layers]
    return torch.cat(keys + [R.token_rows(cache[j][1]) for j in layers], 1)


def with_previous(x, width):
    """x's rows at p, p-1, ..., p-width+1 side by side (zeros before the first token)."""
    parts = [x] + [torch.cat([torch.zeros(s, x.shape[1], dtype=x.dtype), x[:-s]])
                   for s in range(1, width)]
    return torch.cat(parts, 1)


def ridge(x, y, lam=0.01):
    """Centred ridge on the covariance scale (SPEC 4.1); returns the predictor."""
    mx, my = x.mean(0), y.mean(0)
    xc = x - mx
    gram = xc.T @ xc / len(x) + lam * torch.eye(x.shape[1], dtype=x.dtype)
    w = torch.linalg.solve(gram, xc.T @ (y - my) / len(x))
    return lambda z: (z - mx) @ w + my


def query_metric(target, layer, windows, pairs_per_window=2048, seed=0):
    """Per KV head, M_h = E[u u^T] over causal (query t, key p) pairs of the target's own
    attention at `layer`, u = the post-RoPE query of a head reading h rotated back to key
    position p: e^T M_h e is then the mean squared attention-logit error that a content-space
    key error e at h causes (times d). [n_kv, d, d], float64."""
    group = target.config.num_attention_heads // target.n_kv
    generator = torch.Generator().manual_seed(seed)
    total = torch.zeros(target.n_kv, target.head_dim, target.head_dim, dtype=torch.float64)
    count = 0
    for ids in windows:
        _, queries = target.prefill(ids, queries=True)
        q = queries[layer]  # [1, heads, T, d], post-RoPE
        t = torch.randint(0, len(ids), (pairs_per_window,), generator=generator)
        p = (torch.rand(pairs_per_window, generator=generator) * (t + 1)).long()
        cos, sin = target.rotary(q, p[None])
        u, _ = apply_rotary_pos_emb(q[:, :, t], q[:, :, t], cos, -sin)
        u = u[0].double().reshape(target.n_kv, group * pairs_per_window, target.head_dim)
        total += u.transpose(1, 2) @ u
        count += group * pairs_per_window
    return total / count


def logit_loss(metric, sy, key_width):
    """The MLP's loss on standardised outputs: for the key columns, the attention-logit error
    the key error causes (query_metric, each head's metric scaled to trace d, so an isotropic
    metric is the plain MSE), for value columns plain MSE; mean over rows and columns."""
    n_kv, d, _ = metric.shape
    blocks = []
    for h in range(n_kv):
        s = sy[h * d:(h + 1) * d].double()
        a = s[:, None] * metric[h] * s[None, :]
        a = a * d / torch.trace(a)
        blocks.append(torch.linalg.cholesky(a + 1e-6 * torch.eye(d, dtype=a.dtype)))
    factor = torch.block_diag(*blocks).float()

    def loss(e):
        keys = ((e[:, :key_width] @ factor) ** 2).sum()
        return (keys + (e[:, key_width:] ** 2).sum()) / e.numel()
    return loss


def mlp(x, y, hidden, steps, seed=0, loss_of=None):
    """Two hidden ReLU layers on standardised inputs and outputs, Adam (float32); the loss MSE,
    or loss_of(sy)(error) on the standardised error."""
    x, y = x.float(), y.float()
    mx, sx, my, sy = x.mean(0), x.std(0) + 1e-6, y.mean(0), y.std(0) + 1e-6
    # A column (nearly) constant in training, e.g. a byte the calibration windows never hold,
    # is left unscaled: dividing by its tiny spread would blow up held-out rows that have it.
    sx = torch.where(sx < 1e-3, torch.ones_like(sx), sx)
    loss_fn = loss_of(sy) if loss_of else (lambda e: (e ** 2).mean())
    torch.manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(x.shape[1], hidden), torch.nn.ReLU(),
                              torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                              torch.nn.Linear(hidden, y.shape[1]))
    opt = torch.optim.Adam(net.parameters(), 1e-3)
    xn, yn = (x - mx) / sx, (y - my) / sy
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        i = torch.randint(0, len(x), (512,), generator=generator)
        loss = loss_fn(net(xn[i]) - yn[i])
        opt.zero_grad()
        loss.backward()
        opt.step()

    def predict(z):
        with torch.no_grad():
            return (net((z.float() - mx) / sx) * sy + my).double()
    return predict


def share(client, source, target, mapper_id, layer, rows_of, windows, controls, context, values):
    """Long-range share with `layer`'s keys (and, with values, its values) from rows_of(context
    ids) (content space, [T, n * d], keys then values; None: the served mapper's), every other
    layer as served."""
    ce = {"window": [], "control": [], "own_window": [], "own_control": []}
    for kind, group in (("window", windows), ("control", controls)):
        for w in group:
            ctx, cont, tgt = w[:context], w[context:-1], w[context + 1:]
            mapped = R.translate(client, mapper_id, source.prefill(ctx))
            if rows_of is not None:
                rows = rows_of(ctx).float().reshape(len(ctx), (2 if values else 1) * target.n_kv,
                                                    -1).transpose(0, 1)[None]
                keys = target.rope(rows[:, :target.n_kv].contiguous(), 0)
                mapped[layer] = (keys, rows[:, target.n_kv:] if values else mapped[layer][1])
            ce[kind].append(np.mean(target.continuation_nll(mapped, cont, tgt)))
            ce["own_" + kind].append(np.mean(target.continuation_nll(target.prefill(ctx), cont,
                                                                     tgt)))
    gain = np.mean(ce["control"]) - np.mean(ce["window"])
    return float(gain / (np.mean(ce["own_control"]) - np.mean(ce["own_window"])))


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--family", default=R.MODELS)
    p.add_argument("--store", required=True, help="a mapper store with {A}-to-{B}-k{k}")
    p.add_argument("--pair", default="M:L")
    p.add_argument("--k", type=int, default=2)
    p.add_argument("--layer", type=int, default=-1,
                   help="target layer whose keys are replaced (-1: the last)")
    p.add_argument("--calib_windows", type=int, default=64)
    p.add_argument("--calib_sample", default="spread", choices=("spread", "first"),
                   help="calibration windows spread over the split (as the eval's dumps) or its "
                        "first (docs/EVAL.md item 2's table)")
    p.add_argument("--calib_split", default="calib", choices=("calib", "train"),
                   help="where the calibration windows come from (train: the family's training "
                   "split, 16x the calibration split, for data-scaling runs)")
    p.add_argument("--calib_tokens", type=int, default=512)
    p.add_argument("--windows", type=int, default=8)
    p.add_argument("--context", type=int, default=384)
    p.add_argument("--continuation", type=int, default=96)
    p.add_argument("--widths", default="2,4")
    p.add_argument("--mlp_hidden", type=int, default=1024)
    p.add_argument("--mlp_steps", type=int, default=3000)
    p.add_argument("--values", action="store_true",
                   help="replace the layer's values too (maps predict keys and values)")
    p.add_argument("--maps", default="served,ridge_sigma,ridge_all,ridge_window,mlp_all,"
                   "mlp_window,own", help="which maps to run, by short name (also mlp_bytes, "
                   "mlp_window_bytes: the window MLP given the bytes themselves)")
    p.add_argument("--key_loss", default="mse", choices=("mse", "logit"),
                   help="the MLPs' loss on keys: mse, or logit (the mean squared attention-logit "
                        "error under the target's own queries at the layer, query_metric)")
    args = p.parse_args()
    chosen = set(args.maps.split(","))
    known = {"served", "ridge_sigma", "ridge_all", "ridge_window", "mlp_all", "mlp_window", "own",
             "mlp_bytes", "mlp_window_bytes"}
    if not chosen <= known:
        p.error(f"--maps: unknown {sorted(chosen - known)} (known: {sorted(known)})")
    caller = os.environ.get("BUILD_WORKSPACE_DIRECTORY", os.getcwd())
    store = os.path.join(caller, args.store)
    torch.set_num_threads(1)
    a, b = args.pair.split(":")
    source = R.Member(os.path.join(args.family, a))
    target = R.Member(os.path.join(args.family, b))
    layer = args.layer % target.layers
    mapper_id = f"{a}-to-{b}-k{args.k}"
    with open(os.path.join(store, mapper_id, "manifest.yaml")) as f:
        manifest = yaml.safe_load(f)
    sigma = next(e["sigma_k"] for e in manifest["layers"] if e["target_layer"] == layer)
    every = list(range(source.layers))
    calib = R.calib_windows(args.calib_tokens, args.calib_windows, args.calib_split,
                            args.calib_sample)

    def own_rows(ids):  # the target's keys (and values) at `layer`, content space
        cache = target.prefill(ids)[layer]
        rows = [R.token_rows(target.rope(cache[0], 0, inverse=True))]
        return torch.cat(rows + [R.token_rows(cache[1])] if args.values else rows, 1)

    truth = torch.cat([own_rows(ids) for ids in calib])
    heldout = R.heldout_windows(args.calib_tokens, 16)
    heldout_truth = torch.cat([own_rows(ids) for ids in heldout])
    key_width = len(sigma) * source.n_kv * source.head_dim

    def sigma_keys(ids):  # sigma's keys alone, as the served map reads them (SPEC 3)
        return source_features(source, ids, sigma)[:, :key_width]

    def all_layers(ids):
        return source_features(source, ids, every)

    maps = {}
    heldout_error = {}

    def gathered(features, dtype):  # filled in place: no list of pieces beside the whole
        first = features(calib[0])
        x = torch.empty(len(calib) * len(first), first.shape[1], dtype=dtype)
        for i, ids in enumerate(calib):
            x[i * len(first):(i + 1) * len(first)] = first if i == 0 else features(ids)
        return x

    def fitted(label, features, fit, dtype=torch.float64):
        model = fit(gathered(features, dtype), truth.to(dtype))
        predicted = torch.cat([model(features(ids)) for ids in heldout])
        spread = ((heldout_truth - heldout_truth.mean(0)) ** 2).sum()
        heldout_error[label] = round(float(((predicted - heldout_truth) ** 2).sum() / spread), 4)
        print(f"{label}: relative MSE on held-out windows {heldout_error[label]:.4f}", flush=True)
        maps[label] = lambda ids: model(features(ids))

    if "served" in chosen:
        maps["served"] = None
    if "ridge_sigma" in chosen:
        fitted("ridge, sigma", sigma_keys, ridge)
    if "ridge_all" in chosen:
        fitted("ridge, all layers", all_layers, ridge)
    widths = [int(x) for x in args.widths.split(",") if x]
    for w in widths if "ridge_window" in chosen else ():
        fitted(f"ridge, all layers at p..p-{w - 1}",
               lambda ids, w=w: with_previous(all_layers(ids), w), ridge)
    loss_of = None
    if args.key_loss == "logit":
        metric = query_metric(target, layer, calib)
        loss_of = lambda sy: logit_loss(metric, sy, target.n_kv * target.head_dim)  # noqa: E731
    train_mlp = lambda x, y: mlp(x, y, args.mlp_hidden, args.mlp_steps,  # noqa: E731
                                 loss_of=loss_of)
    mlp_dtype = torch.float32  # the MLP trains in float32: gather its inputs so (half the memory)
    if "mlp_all" in chosen:
        fitted("MLP, all layers", all_layers, train_mlp, mlp_dtype)
    if widths and "mlp_window" in chosen:
        w = max(widths)
        fitted(f"MLP, all layers at p..p-{w - 1}",
               lambda ids: with_previous(all_layers(ids), w), train_mlp, mlp_dtype)
    # Not servable (a mapper sees the source cache, not the text): how far the bytes at
    # p..p-w+1 themselves, alone or beside the source's cache, take the window MLP.
    def one_hot(ids):
        return torch.nn.functional.one_hot(torch.tensor(ids), 256).double()
    if widths and "mlp_bytes" in chosen:
        w = max(widths)
        fitted(f"MLP, bytes at p..p-{w - 1}", lambda ids: with_previous(one_hot(ids), w),
               train_mlp, mlp_dtype)
    if widths and "mlp_window_bytes" in chosen:
        w = max(widths)
        fitted(f"MLP, all layers and bytes at p..p-{w - 1}",
               lambda ids: with_previous(torch.cat([all_layers(ids), one_hot(ids)], 1), w),
               train_mlp, mlp_dtype)
    if "own" in chosen:
        maps["own"] = own_rows
    windows, controls = R.copy_windows(args.context, args.continuation, args.windows)
    results = {}
    replaced = "keys and values" if args.values else "keys"
    with R.start_kvtd(store) as server, kvt.Client(server.address, timeout=120) as client:
        for label, keys_of in maps.items():
            results[label] = round(share(client, source, target, mapper_id, layer, keys_of,
                                         windows, controls, args.context, args.values), 4)
            print(f"{args.pair} layer {layer} {replaced} from {label}: long-range share "
                  f"{results[label]:.3f}", flush=True)
    print(json.dumps({"pair": args.pair, "layer": layer, "sigma": sigma, "windows": args.windows,
                      "replaced": replaced, "calib_windows": args.calib_windows,
                      "calib_split": args.calib_split, "calib_sample": args.calib_sample,
                      "mlp_steps": args.mlp_steps, "key_loss": args.key_loss, "share": results,
                      "heldout_relative_mse": heldout_error}))


if __name__ == "__main__":
    main()
