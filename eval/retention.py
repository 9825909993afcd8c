"""Retention evaluation of kvt on the bundled tiny family (docs/EVAL.md).

The pipeline, all on real parts: tools/dump_kv.py dumps each model's calibration KV through
transformers' LlamaForCausalLM; `kvt fit` fits a mapper per ordered pair and k; a kvtd process
serves the mapper store; the `kvt` Python client (clients/python) translates over gRPC and asks
kvtd's ValidateKV for R^2, attention-output cosine, c_K and c_V. On held-out documents
(eval/tinyfamily/corpus.py: never seen in training or calibration) the target's cross-entropy on
a continuation is measured after: its own prefill of the context; the translated cache; no
context; a token-identity map (ridge from one-hot current and previous byte to the target's K/V:
the control that exposes caches that are trivially "linear" in the tokens); the translated cache
of an untrained source (random weights, its own fitted mapper); the source's KV untranslated
(when the KV shapes match; target layer l gets source layer floor(l * L_s / L_t)); and the
translated cache with the target RoPE not re-applied (ablation).

context benefit recovered = (CE_none - CE_x) / (CE_none - CE_own), on all continuation tokens
and on the first 16 after the cache boundary; the perplexity ratio exp(CE_x - CE_own) is the
secondary figure (it overstates retention when context helps little; SPEC 5).

Long-range windows: copy_windows (a passage repeated after a gap) and lookup_windows
(key -> value pairs planted in the context), each with a control window that differs only in
what lies far back; evaluate_long_range measures every condition on both (the copy gain).
"""

import json
import math
import os

import numpy as np
import torch

import dump_kv  # tools/dump_kv.py
import intervals
import model as tiny  # eval/tinyfamily
from kvt import adapters, qualify
from kvt_testing.kvtd import Kvtd
# The family's members, text, dumps, fits and measures, shared with tests/vllm; imported here
# under these names for the evaluation programs (R.Member, R.fit, ...).
from kvt_testing.tinyfamily import (FIRST, MLP_FLAGS, MODELS, Member, benefit,  # noqa: F401
                                    dump, fit, heldout_windows, nll_of, summarize, token_stream,
                                    translate, write_documents, write_split)


# -- models ------------------------------------------------------------------------------------

# Per position KL(own || logp) of two next-token log-probability rows (torch, so that
# eval/refine_through_target can take its gradient): kvt.qualify's, one formula for both.
kl_of = qualify.kl_of


class Scores:
    """Per condition and window, the target's per-token NLL of the continuation and the KL
    divergence KL(own || condition) of its next-token distribution from the one its own prefill
    gives. The KL measures what a translated cache is for, making the target behave as after
    its own prefill, with no reference text: CE on the text can prefer a cache that moves the
    target away from its own prediction (into S, docs/EVAL.md "Reading the numbers")."""

    def __init__(self, target):
        self.target = target
        self.nll, self.kl = {}, {}

    def window(self, own_layers, cont, targets, prefix=""):
        """Starts a window: scores `own` (its KL is 0) and keeps its distribution; `prefix`
        goes before every key of the window (the long-range control windows)."""
        self.cont, self.targets, self.prefix = cont, targets, prefix
        self.own = self.target.continuation_logprobs(own_layers, cont)
        self._record("own", self.own)

    def add(self, key, layers):
        self._record(key, self.target.continuation_logprobs(layers, self.cont))

    def _record(self, key, logp):
        key = self.prefix + key
        self.nll.setdefault(key, []).append(nll_of(logp, self.targets))
        self.kl.setdefault(key, []).append(kl_of(self.own, logp).numpy())


def make_untrained(source_dir, out_dir, seed=7):
    """The source's architecture with random weights (the untrained-source control)."""
    with open(os.path.join(source_dir, "config.json")) as f:
        config = json.load(f)
    config["_name_or_path"] = config["_name_or_path"] + "-untrained"
    m = tiny.Llama(config)
    m.init_weights(seed)
    tiny.save(m, out_dir)
    return out_dir


# -- text --------------------------------------------------------------------------------------

def calib_windows(tokens, count, split="calib", sample="spread"):
    """The calibration windows `dump` dumps (dump_kv.py's default --sample spread: evenly spaced
    over the whole split, not its first documents), for the maps fitted here in Python.
    sample "first": the split's first windows (how the evaluation sampled before 2026-12-05)."""
    if sample == "first":
        return list(dump_kv.windows(token_stream(split), tokens, count))
    return list(dump_kv.spread_windows(lambda: token_stream(split), tokens, count))


def copy_windows(context, continuation, count, seed=0):
    """Held-out windows whose continuation depends on context far back: the continuation is a
    passage that also opens the context, context - continuation - 1 bytes earlier, with
    unrelated held-out text between. Returns (windows, controls): each control is its window
    with the opening passage replaced by other text, so the two differ only in the copy."""
    stream = [t for ids in token_stream("heldout") for t in ids]
    rng = np.random.default_rng(seed)
    n = continuation + 1
    windows, controls = [], []
    for _ in range(count):
        s, f, o = (int(rng.integers(0, len(stream) - context - n)) for _ in range(3))
        passage, filler, other = stream[s:s + n], stream[f:f + context - n], stream[o:o + n]
        windows.append(passage + filler + passage)
        controls.append(other + filler + passage)
    return windows, controls


def lookup_windows(context, continuation, count, seed=0):
    """Held-out windows with key -> value lookups planted in the context: "abc=12345;" pairs (a
    random 3-letter key, a random 5-digit value) at random places in held-out text, and the
    continuation the same pairs again in another order, so only the context can tell the values.
    Returns (windows, controls): each control is its window with other values planted in the
    context (the continuation unchanged), so the two differ only in what the lookup finds."""
    stream = [t for ids in token_stream("heldout") for t in ids]
    tok = dump_kv.ByteTokenizer()
    rng = np.random.default_rng(seed)
    n = continuation + 1
    pairs = -(-n // 10)  # each "abc=12345;" is 10 bytes
    windows, controls = [], []
    for _ in range(count):
        keys = ["".join(chr(97 + int(c)) for c in rng.integers(0, 26, 3)) for _ in range(pairs)]
        values = [[f"{int(v):05d}" for v in rng.integers(0, 100000, pairs)] for _ in range(2)]
        f = int(rng.integers(0, len(stream) - context))
        filler = stream[f:f + context - 10 * pairs]
        places = sorted(int(x) for x in rng.choice(len(filler) + 1, pairs, replace=False))
        order = rng.permutation(pairs)
        cont = tok.encode("".join(f"{keys[i]}={values[0][i]};" for i in order))[:n]
        out = []
        for vals in values:
            ctx = []
            for i, (a, b) in enumerate(zip([0] + places, places + [len(filler)])):
                ctx += filler[a:b]
                if i < pairs:
                    ctx += tok.encode(f"{keys[i]}={vals[i]};")
            out.append(ctx + cont)
        windows.append(out[0])
        controls.append(out[1])
    return windows, controls


def copy_gain(member, windows, controls, context):
    """Mean nats/byte the earlier copy saves on the continuation (controls minus windows), on
    the member's own prefill: how much the model can use context far back."""
    gains = []
    for w, c in zip(windows, controls):
        nll = []
        for ids in (c, w):
            own = member.prefill(ids[:context])
            nll.append(float(np.mean(member.continuation_nll(own, ids[context:-1],
                                                             ids[context + 1:]))))
        gains.append(nll[0] - nll[1])
    return float(np.mean(gains))


# -- pipeline: dumps, fits, kvtd ---------------------------------------------------------------

def start_kvtd(store, config=None):
    """kvtd serving `store` on the CPU backend; config: a kvtd YAML (e.g. the source-cache tier
    and its quality gate on, handoff_demo)."""
    return Kvtd(["--listen_address=127.0.0.1:0", f"--mapper_store={store}", "--backend=cpu",
                 "--cpu_threads=1", "--drain_grace_seconds=0", "--max_tokens=65536"] +
                ([f"--config={config}"] if config else []), "eval-kvtd")


# -- controls ----------------------------------------------------------------------------------

def token_rows(t):
    """[1, heads, T, d] -> [T, heads * d] float64 (head-major per token, as SPEC 3 flattens)."""
    return t[0].permute(1, 0, 2).reshape(t.shape[2], -1).double()


class TokenIdentityMap:
    """Ridge (float64) from one-hot(current byte) + one-hot(previous byte) + 1 to the target's
    content-space K (RoPE stripped) and V, per layer; predictions get the target RoPE back."""

    FEATURES = 256 + 257 + 1  # previous byte has an extra "none" slot at position 0

    def __init__(self, target, windows, lam=1.0):
        self.target = target
        gram = np.zeros((self.FEATURES, self.FEATURES))
        cross = None
        for ids in windows:
            x = self.features(ids)
            layers = target.prefill(ids)
            y = np.concatenate([token_rows(target.rope(k, 0, inverse=True)).numpy()
                                for k, _ in layers] +
                               [token_rows(v).numpy() for _, v in layers], axis=1)
            gram += x.T @ x
            cross = x.T @ y if cross is None else cross + x.T @ y
        self.w = np.linalg.solve(gram + lam * np.eye(self.FEATURES), cross)

    def features(self, ids):
        x = np.zeros((len(ids), self.FEATURES))
        rows = np.arange(len(ids))
        x[rows, ids] = 1.0
        prev = np.array([256] + list(ids[:-1])) + 256
        x[rows, prev] = 1.0
        x[:, -1] = 1.0
        return x

    def predict(self, ids):
        t = self.target
        y = self.features(ids) @ self.w
        width = t.n_kv * t.head_dim
        out = []
        for j in range(t.layers):
            def block(col):
                a = torch.from_numpy(y[:, col * width:(col + 1) * width]).float()
                return a.reshape(len(ids), t.n_kv, t.head_dim).permute(1, 0, 2)[None].contiguous()
            out.append((t.rope(block(j), 0), block(t.layers + j)))
        return out


def untranslated(source_layers, target):
    """The source's KV as the target's cache (same KV shapes only), layers spread by depth."""
    ls = len(source_layers)
    return [source_layers[(l * ls) // target.layers] for l in range(target.layers)]


# -- measures ----------------------------------------------------------------------------------

def strip_target_rope(target, layers):
    return [(target.rope(k, 0, inverse=True), v) for k, v in layers]


def window_means(per_token):
    """{condition: [mean per window]} of Scores' per-token lists: what eval/intervals.py
    resamples (the continuations have one length, so their mean is the figure's mean)."""
    return {key: [round(float(np.mean(x)), 7) for x in v] for key, v in per_token.items()}


def evaluate_pair(client, source, target, mapper_id, windows, context, extra):
    """CE of the target on each window's continuation under every condition, plus ValidateKV.

    extra: {"identity": TokenIdentityMap, "untrained": (Member, mapper_id)} (either may be
    missing). Returns {"ce": summarize(...), "benefit": ..., "validate": ...}."""
    scores = Scores(target)
    quality = []
    for ids in windows:
        ctx, cont, tgt = ids[:context], ids[context:-1], ids[context + 1:]
        own, queries = target.prefill(ctx, queries=True)
        src = source.prefill(ctx)
        mapped = translate(client, mapper_id, src)
        scores.window(own, cont, tgt)
        scores.add("none", None)
        scores.add("mapped", mapped)
        scores.add("no_target_rope", strip_target_rope(target, mapped))
        if "identity" in extra:
            scores.add("identity", extra["identity"].predict(ctx))
        if "untrained" in extra:
            member, mid = extra["untrained"]
            scores.add("untrained", translate(client, mid, member.prefill(ctx)))
        if source.n_kv == target.n_kv and source.head_dim == target.head_dim:
            scores.add("untranslated", untranslated(src, target))
        q = [(qq, qq) for qq in queries]
        response = client.validate(adapters.from_torch(src), adapters.from_torch(own),
                                   adapters.from_torch(q), mapper_id=mapper_id)
        quality.append(response)
    ce = summarize(scores.nll)
    result = {"ce": ce, "kl": summarize(scores.kl), "windows": len(windows), "context": context,
              "continuation": len(windows[0]) - context - 1,
              "per_window": {"ce": window_means(scores.nll)}}
    result["benefit"] = {key: {"all": benefit(ce, key), "first": benefit(ce, key, "first")}
                         for key in ce if key not in ("own", "none")}
    result["ppl_ratio"] = {key: math.exp(ce[key]["all"] - ce["own"]["all"])
                           for key in ce if key != "own"}

    def mean(field, which):
        vals = [getattr(getattr(r, which), field) for r in quality]
        return float(np.mean(vals))
    result["validate"] = {
        which: {f: mean(f, which) for f in ("r2_k", "r2_v", "cosine_k", "cosine_v",
                                              "attention_cosine", "c_k", "c_v")}
        for which in ("overall", "overall_without_layer0")}
    result["validate"]["layers"] = [
        {"layer": int(l.layer), "r2_k": float(np.mean([r.layers[i].r2_k for r in quality])),
         "r2_v": float(np.mean([r.layers[i].r2_v for r in quality]))}
        for i, l in enumerate(quality[0].layers)]
    return result


def evaluate_kinds(client, source, target, mapper_ids, windows, context, sources=None):
    """Side by side for several mappers of one pair ({label: mapper_id}, e.g. ridge and mlp):
    per label the context benefit recovered (all, first 16), the perplexity ratio and kvtd's
    ValidateKV figures (attention-output cosine, c_K, c_V, R^2) on the same held-out windows.
    sources {label: Member}: labels whose mapper reads another source (the untrained-source
    controls); the others read `source`."""
    sources = sources or {}
    scores = Scores(target)
    quality = {label: [] for label in mapper_ids}
    for ids in windows:
        ctx, cont, tgt = ids[:context], ids[context:-1], ids[context + 1:]
        own, queries = target.prefill(ctx, queries=True)
        prefills = {}
        scores.window(own, cont, tgt)
        scores.add("none", None)
        q = adapters.from_torch([(qq, qq) for qq in queries])
        for label, mid in mapper_ids.items():
            member = sources.get(label, source)
            if member.dir not in prefills:
                prefills[member.dir] = member.prefill(ctx)
            src = prefills[member.dir]
            mapped = translate(client, mid, src)
            scores.add(label, mapped)
            scores.add(label + NO_ROPE, strip_target_rope(target, mapped))
            quality[label].append(client.validate(adapters.from_torch(src),
                                                  adapters.from_torch(own), q, mapper_id=mid))
    ce, kl = summarize(scores.nll), summarize(scores.kl)
    out = {}
    for label in mapper_ids:
        rs = quality[label]
        v = {f: float(np.mean([getattr(r.overall, f) for r in rs]))
             for f in ("r2_k", "r2_v", "attention_cosine", "c_k", "c_v")}
        v["attention_cosine_without_layer0"] = float(np.mean(
            [r.overall_without_layer0.attention_cosine for r in rs]))
        out[label] = {"ce": ce[label]["all"], "benefit": benefit(ce, label),
                      "benefit_first": benefit(ce, label, "first"),
                      "ppl_ratio": math.exp(ce[label]["all"] - ce["own"]["all"]), "validate": v,
                      "benefit_no_target_rope": benefit(ce, label + NO_ROPE),
                      "benefit_no_target_rope_first": benefit(ce, label + NO_ROPE, "first"),
                      "kl": kl[label]["all"], "kl_first": kl[label]["first"],
                      "kl_no_target_rope": kl[label + NO_ROPE]["all"]}
    out["ce"] = {"own": ce["own"]["all"], "none": ce["none"]["all"]}
    out["kl"] = {"none": kl["none"]["all"]}
    out["per_window"] = {"ce": window_means(scores.nll), "kl": window_means(scores.kl)}
    return out


NO_ROPE = "_no_target_rope"
CONTROL = "control_"


def evaluate_long_range(client, source, target, mapper_ids, windows, controls, context,
                        identity=None, untrained=None):
    """The long-range windows (copy_windows, lookup_windows) for several mappers of one pair.

    mapper_ids {label: mapper_id}; identity: the target's TokenIdentityMap; untrained {label:
    (Member, mapper_id)}: the untrained-source control of each mapper kind. Per condition the
    CE (nats/byte; all, first 16) and KL to own (Scores) on the windows, the benefit recovered
    against no context, and
    for own, each mapper and each control (token identity, untrained source, no target RoPE) the
    copy gain: CE on the control windows (the earlier copy or the planted values replaced) minus
    CE on the windows, i.e. how much of the continuation comes from context far back. long_range[label] = copy gain of the label / copy gain of own: the
    share of the long-range benefit recovered (undefined when own gains ~0)."""
    scores = Scores(target)
    for ids, ctrl in zip(windows, controls):
        for prefix, w in (("", ids), (CONTROL, ctrl)):
            ctx, cont, tgt = w[:context], w[context:-1], w[context + 1:]
            src = source.prefill(ctx)
            scores.window(target.prefill(ctx), cont, tgt, prefix)
            for label, mid in mapper_ids.items():
                mapped = translate(client, mid, src)
                scores.add(label, mapped)
                scores.add(label + NO_ROPE, strip_target_rope(target, mapped))
            # The controls on the control windows too: their copy gain is the control's test
            # (near 0 for token identity and an untrained source, collapsed without RoPE).
            if identity is not None:
                scores.add("identity", identity.predict(ctx))
            for label, (member, mid) in (untrained or {}).items():
                scores.add(label + "_untrained", translate(client, mid, member.prefill(ctx)))
            if not prefix:
                scores.add("none", None)
    ce, kl = summarize(scores.nll), summarize(scores.kl)
    shown = [key for key in ce if not key.startswith(CONTROL)]
    gain = {key: ce[CONTROL + key]["all"] - ce[key]["all"] for key in shown
            if CONTROL + key in ce}
    return {"ce": {key: ce[key] for key in shown},
            "control_ce": {key[len(CONTROL):]: v for key, v in ce.items()
                           if key.startswith(CONTROL)},
            "benefit": {key: {"all": benefit(ce, key), "first": benefit(ce, key, "first")}
                        for key in shown if key not in ("own", "none")},
            "copy_gain": gain,
            "kl": {key: kl[key] for key in shown if key != "own"},
            "long_range": {key: gain[key] / gain["own"] if gain["own"] != 0 else float("nan")
                           for key in gain if key != "own"},
            "windows": len(windows), "context": context,
            "continuation": len(windows[0]) - context - 1,
            "per_window": {"ce": window_means(scores.nll)}}


def copy_layer_probe(client, source, target, mapper_id, windows, controls, context):
    """Where a translated cache loses the copy: per target layer l, the long-range share (copy
    gain / own copy gain) of the translated cache with the target's own keys at layer l (`k`)
    and with its own keys and values there (`kv`), every other layer translated. A layer whose
    own keys bring the share near 1 is where the target looks the copy up (its induction
    heads); the mapper's error there is what the share pays for."""
    ce = {}
    for prefix, group in (("", windows), (CONTROL, controls)):
        for w in group:
            ctx, cont, tgt = w[:context], w[context:-1], w[context + 1:]
            own = target.prefill(ctx)
            mapped = translate(client, mapper_id, source.prefill(ctx))
            conditions = {"own": own, "mapped": mapped}
            for l in range(target.layers):
                conditions[f"k{l}"] = [(own[i][0], mapped[i][1]) if i == l else mapped[i]
                                       for i in range(target.layers)]
                conditions[f"kv{l}"] = [own[i] if i == l else mapped[i]
                                        for i in range(target.layers)]
            for key, layers in conditions.items():
                ce.setdefault(prefix + key, []).append(
                    float(np.mean(target.continuation_nll(layers, cont, tgt))))
    gain = {key: np.mean(ce[CONTROL + key]) - np.mean(ce[key]) for key in ce
            if not key.startswith(CONTROL)}
    share = {key: float(g / gain["own"]) for key, g in gain.items() if key != "own"}
    return {"own_copy_gain": float(gain["own"]), "mapped": share["mapped"],
            "k": [share[f"k{l}"] for l in range(target.layers)],
            "kv": [share[f"kv{l}"] for l in range(target.layers)]}


def multi_turn(client, a, b, mapper_ab, mapper_ba, windows, segment, turns):
    """Alternating handoffs: a reads segment 1; at each turn the whole cache is translated to
    the other model, which is scored on the next segment and appends it with its own forward
    pass. Returns per turn the benefit recovered (vs that model's own prefill of all text so
    far and vs no context)."""
    per_turn = []
    for t in range(turns):
        per_turn.append({"own": [], "none": [], "mapped": []})
    for ids in windows:
        cache = a.prefill(ids[:segment])
        holder = a
        for t in range(turns):
            receiver, mid = (b, mapper_ab) if holder is a else (a, mapper_ba)
            translated = translate(client, mid, cache)
            start = (t + 1) * segment
            cont, tgt = ids[start:start + segment], ids[start + 1:start + segment + 1]
            per_turn[t]["mapped"].append(receiver.continuation_nll(translated, cont, tgt))
            per_turn[t]["own"].append(receiver.continuation_nll(receiver.prefill(ids[:start]),
                                                                cont, tgt))
            per_turn[t]["none"].append(receiver.continuation_nll(None, cont, tgt))
            # The receiver's cache now holds the translated prefix plus its own segment.
            cache_obj = adapters.to_dynamic_cache(adapters.from_torch(translated))
            with torch.no_grad():
                receiver.hf(input_ids=torch.tensor([cont]), past_key_values=cache_obj,
                            use_cache=True)
            cache = [(k.clone(), v.clone()) for k, v in adapters.dynamic_cache_layers(cache_obj)]
            holder = receiver
    out = []
    for t, d in enumerate(per_turn):
        ce = summarize(d)
        out.append({"turn": t + 1, "receiver": (b if t % 2 == 0 else a).name,
                    "benefit": benefit(ce, "mapped"), "ce": ce})
    return out
