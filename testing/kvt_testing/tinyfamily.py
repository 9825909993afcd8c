"""The bundled tiny Llama family (eval/tinyfamily) as the evaluation harness (eval/retention.py)
and the vLLM tests (tests/vllm) both use it: a member through transformers' LlamaForCausalLM
(Member), the corpus splits as token streams and held-out windows, KV dumps (tools/dump_kv.py),
`kvt fit` of a pair, a translation through kvt.Client as torch layers, and the context-benefit
measure on the continuation's cross-entropy (docs/EVAL.md).
"""

import hashlib
import json
import os
import shutil
import subprocess

import numpy as np
import torch
from transformers import LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

import corpus  # eval/tinyfamily
import dump_kv  # tools/dump_kv.py
from kvt import qualify, text
from kvt_testing.runfiles import ROOT, runfile

# The committed members' directories (config.json, model.safetensors): S, M, L, U.
MODELS = os.path.join(ROOT, "eval", "tinyfamily", "models")

FIRST = 16  # tokens right after the cache boundary, reported separately


# -- models ------------------------------------------------------------------------------------

class Member:
    """One family member loaded through transformers (the real Hugging Face code path). The
    cache and the continuation's scores come from kvt.qualify (one home for any causal LM);
    Member adds the Llama specifics: RoPE and the post-RoPE queries."""

    def __init__(self, directory):
        self.dir = directory
        self.hf = LlamaForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        self.config = self.hf.config
        # from_pretrained overwrites _name_or_path with the directory; the model's name is the
        # one its config.json records.
        with open(os.path.join(directory, "config.json")) as f:
            self.name = json.load(f)["_name_or_path"]
        self.rotary = LlamaRotaryEmbedding(config=self.config)
        self.n_kv = self.config.num_key_value_heads
        self.head_dim = self.config.hidden_size // self.config.num_attention_heads
        self.layers = self.config.num_hidden_layers

    def rope(self, x, start, inverse=False):
        """x [1, heads, T, d] rotated to positions start.. (inverse: rotated back)."""
        positions = torch.arange(start, start + x.shape[2])[None]
        cos, sin = self.rotary(x, positions)
        rotated, _ = apply_rotary_pos_emb(x, x, cos, -sin if inverse else sin)
        return rotated

    def prefill(self, ids, queries=False):
        """Per-layer (K, V) [1, n_kv, T, d] of the context (and post-RoPE queries if asked)."""
        captured = []
        hooks = []
        if queries:
            for layer in self.hf.model.layers:
                hooks.append(layer.self_attn.q_proj.register_forward_hook(
                    lambda mod, inp, out: captured.append(out)))
        try:
            layers = qualify.prefill(self.hf, ids)
        finally:
            for h in hooks:
                h.remove()
        if not queries:
            return layers
        heads = self.config.num_attention_heads
        q = [self.rope(c.view(1, len(ids), heads, self.head_dim).transpose(1, 2), 0)
             for c in captured]
        return layers, q

    def continuation_logprobs(self, layers, cont):
        """Next-token log-probabilities [len(cont), vocab] (float64) after feeding `cont` on top
        of the cache `layers` (None: no context, positions from 0): kvt.qualify's, which
        measures a mapper on an operator's text the way the evaluation measures it here."""
        return qualify.continuation_logprobs(self.hf, layers, cont)

    def continuation_nll(self, layers, cont, targets):
        """Per-token negative log-likelihood (nats, float64) of `targets` after feeding `cont`
        on top of the cache `layers` (None: no context, positions from 0)."""
        return nll_of(self.continuation_logprobs(layers, cont), targets)


nll_of = qualify.nll_of


# -- text ---------------------------------------------------------------------------------------

def write_documents(path, texts):
    """The texts as JSON lines ({"text": ...}), what `kvt fit`'s dumps and kvt.qualify read."""
    with open(path, "w", encoding="utf-8") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")
    return path


def write_split(name, path, reverse=False):
    """The corpus split's documents as JSON lines; reverse: in reverse order, so windows spread
    evenly over it are other cuts of the same text than heldout_windows'."""
    docs = [d["text"] for d in corpus.splits()[name]]
    return write_documents(path, docs[::-1] if reverse else docs)


def token_stream(name):
    tok = dump_kv.ByteTokenizer()
    for d in corpus.splits()[name]:
        yield tok.encode(d["text"]) + [tok.eos_token_id]


def heldout_windows(length, count):
    """`count` windows of `length` bytes spread evenly over the held-out documents (as
    kvt.qualify spreads its windows: kvt.text.spread_windows)."""
    stream = [t for ids in token_stream("heldout") for t in ids]
    return text.spread_windows(stream, length, count)


# -- dumps and fits -----------------------------------------------------------------------------

def dump(member_dir, calib_jsonl, out, tokens, sequences, queries=False):
    """Dumps reused from an earlier run in the same work directory only when they were made from
    the same weights and settings (a retrained member must not be fitted on its old caches).
    queries: also the post-RoPE queries (dump_kv.py --queries), which `kvt fit --kind both` needs
    on the target side."""
    h = hashlib.sha256()
    with open(os.path.join(member_dir, "model.safetensors"), "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    h.update(f"{tokens} {sequences} spread {calib_jsonl}{' queries' if queries else ''}".encode())
    stamp = out.rstrip("/") + ".made_from.sha256"  # beside the dump: kvt fit reads the folder
    fresh = (os.path.exists(os.path.join(out, "config.json")) and os.path.exists(stamp)
             and open(stamp).read().strip() == h.hexdigest())
    if not fresh:
        shutil.rmtree(out, ignore_errors=True)
        dump_kv.main(["--model", member_dir, "--corpus", calib_jsonl, "--out", out,
                      "--tokens", str(tokens), "--sequences", str(sequences), "--sample",
                      "spread", "--dtype", "fp32",
                      "--tokenizer", "bytes", "--corpus_name", corpus.PACKAGE] +
                     (["--queries"] if queries else []))
        with open(stamp, "w") as f:
            f.write(h.hexdigest() + "\n")
    return out


# MLP training for the evaluation (docs/EVAL.md): small enough that every ordered pair of the
# family trains in minutes on one core. The calibration set is ~30K tokens, so the paper's batch
# of 4096 would give a handful of Adam steps per epoch; 256 gives ~100. Every row and hidden 512
# (M -> L window MLP, 2026-12-05: copy share 0.44 -> 0.54, KL 0.204 -> 0.161 against hidden 256
# on 16384 rows, 3x the fit time; hidden 1024 0.58 / 0.165 at 8x).
MLP_FLAGS = {"mlp_hidden": 512, "mlp_epochs": 10, "mlp_batch": 256, "mlp_lr": 1e-3,
             "mlp_max_observations": 0}


def fit(source_dump, target_dump, source_name, target_name, k, out, stride=1, kind="ridge",
        mlp_flags=None, refine=False, unrefined_mlp_out=None, extra=()):
    """`kvt fit` of one ordered pair into `out` (kind both: out/ridge, out/mlp and
    out/fit_report.json, whose dict this returns; else the mapper directory). refine: `kvt fit
    --refine=attention` (the mapper, for kind both each half, refined on the target's attention
    outputs, its default steps; the target dump must carry queries). unrefined_mlp_out (kind
    mlp or both, with refine): also write the MSE-trained MLP, the refinement's start, there.
    extra: more `kvt fit` flags (eval/compare_fits's variants)."""
    cmd = [runfile("cli/kvt"), "fit", f"--source_config={source_dump}",
           f"--target_config={target_dump}", f"--source_model={source_name}",
           f"--target_model={target_name}", f"--source_dumps={source_dump}",
           f"--target_dumps={target_dump}", f"--top_k={k}", f"--stride={stride}",
           f"--corpus={corpus.PACKAGE}", "--threads=1", "--overwrite", f"--out={out}",
           f"--kind={kind}"]
    if kind != "ridge":
        cmd += [f"--{key}={value}" for key, value in (mlp_flags or MLP_FLAGS).items()]
    if refine:
        cmd.append("--refine=attention")
    if unrefined_mlp_out:
        cmd.append(f"--unrefined_mlp_out={unrefined_mlp_out}")
    cmd += list(extra)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"kvt fit failed ({done.returncode}): {' '.join(cmd)}\n"
                           f"{done.stdout}\n{done.stderr}")
    if kind == "both":
        with open(os.path.join(out, "fit_report.json")) as f:
            return json.load(f)
    return out


# -- measures ----------------------------------------------------------------------------------

translate = qualify.translate


def benefit(ce, key, part="all"):
    """Context benefit recovered by condition `key`, (CE_none - CE_key) / (CE_none - CE_own)
    (eval/intervals.benefit_of), on summarize()'s means; nan where own and none agree."""
    means = {k: ce[k][part] for k in ("own", "none", key)}
    if means["none"] == means["own"]:
        return float("nan")
    return (means["none"] - means[key]) / (means["none"] - means["own"])


def summarize(nll):
    """{condition: {"all": mean nats, "first": mean over the first FIRST tokens}}."""
    return {key: {"all": float(np.mean(np.concatenate(v))),
                  "first": float(np.mean(np.concatenate([x[:FIRST] for x in v])))}
            for key, v in nll.items()}
