"""kvt on transformers' Qwen3 architecture (QK-norm, an explicit head_dim of 128 that is not
hidden_size / num_attention_heads, neox RoPE with theta 1e6), end to end on real parts: the tiny
Qwen3 pair of tests/vllm/qwen3_shapes.py (random weights written here), real vLLM engines with the
KvtConnector, a real kvtd, `kvt fit` on tools/dump_kv.py dumps, the HF adapters.

  * An identity mapper (k = 1, W = I, b = 0) from a twin name of model A to A reproduces a plain
    run of engine A: greedy tokens equal and log-probabilities within float rounding, whether the
    prefix was published by the Python client (transformers' own cache of A) or by a second vLLM
    engine serving A's weights under the twin's name; on every load path (in place, the load
    region, inline). The same with V zeroed changes the output (the load is really used).
  * What engine A publishes is A's own cache: read back through the reverse identity it equals
    transformers' cache within float rounding.
  * kvtd's content-space strip is right for head_dim 128 and theta 1e6: an identity whose target
    RoPE has another theta returns transformers' pre-RoPE keys (after QK-norm) rotated at that
    theta.
  * The HF adapters: a cache kvtd translated, as a transformers DynamicCache, continues the
    prompt as a full forward pass does.
  * tools/dump_kv.py dumps both models of the pair and `kvt fit` fits A -> B (the manifest carries
    the engines' model names, head_dim 128 and neox RoPE at theta 1e6), and A onto its twin, which
    kvtd serves as (nearly) the identity.
"""

import os
import sys
import time
import unittest

import numpy as np
import torch
import yaml

import engines as E
from engines import outcome
import family
import qwen3_shapes as Q

import kvt
from kvt import adapters
from kvt.cache import DTYPE_NAMES
from kvt.prefix import PrefixCache
from kvt_testing import tinyfamily

WORK = os.environ.get("TEST_TMPDIR") or "/tmp/kvt-qwen3-test"
A, B = Q.TINY_PAIR
TWIN = A + "-twin"       # a second name for A's weights: the source of the identity mappers
PROBE_THETA = 1e4        # the target RoPE theta of the strip probe
GEN = 12
CALIB_TOKENS, CALIB_WINDOWS = 128, 12

PROMPT = list(b"The Python tutorial: an informal introduction. Numbers, strings and lists; "
              b"control flow with if, for and while; functions with default arguments. " * 3)


class Suite:
    kvtd = None
    store = ""
    dirs = {}
    engines = {}
    fitted = {}


def setUpModule():
    torch.set_num_threads(1)
    os.makedirs(WORK, exist_ok=True)
    models = os.path.join(WORK, "models")
    Suite.dirs = {name: Q.write_model(models, name, seed=i + 1)
                  for i, name in enumerate(Q.TINY_PAIR)}
    port = E.free_port()
    common = {"kvtd_address": f"127.0.0.1:{port}", "lookup_timeout_s": 2.0,
              "translate_timeout_s": 30.0}
    # Engine T serves A's weights under the twin's name: what it publishes is A's cache as a
    # source the identity maps from.
    Suite.engines = {
        "A": E.Engine("A", Suite.dirs[A], {**common, "model_name": A}, WORK),
        "T": E.Engine("T", Suite.dirs[A], {**common, "model_name": TWIN}, WORK),
    }
    for engine in Suite.engines.values():
        engine.start()
    try:
        store = Suite.store = os.path.join(WORK, "store")
        Q.identity_mapper(store, "twin-to-A", A, TWIN)
        Q.identity_mapper(store, "twin-to-A-zero-v", A, TWIN, zero_v=True)
        Q.identity_mapper(store, "A-to-twin", A, A, target_name=TWIN)  # reads back A's publish
        Q.identity_mapper(store, "A-rope-probe", A, A, target_name=A + "-probe",
                          target_theta=PROBE_THETA)
        Q.synth_mapper(store, A, B)
        # Dumps and fits while the engines start.
        calib = tinyfamily.write_split("calib", os.path.join(WORK, "calib.jsonl"))
        dumps = {name: tinyfamily.dump(Suite.dirs[name], calib,
                                       os.path.join(WORK, "dumps", name), CALIB_TOKENS,
                                       CALIB_WINDOWS) for name in Q.TINY_PAIR}
        Suite.fitted["A-to-B"] = tinyfamily.fit(dumps[A], dumps[B], A, B, 2,
                                                os.path.join(store, "fit-A-to-B"))
        Suite.fitted["A-to-twin"] = tinyfamily.fit(dumps[A], dumps[A], A, TWIN + "-fit", 1,
                                                   os.path.join(store, "fit-A-to-twin"))
        config = family.kvtd_yaml(os.path.join(WORK, "kvtd.yaml"))
        Suite.kvtd = family.start_kvtd(store, port, config, "qwen3-kvtd").__enter__()
        for engine in Suite.engines.values():
            engine.wait_ready()
    except BaseException:
        tearDownModule()
        raise
    print("engines started in " + ", ".join(f"{n} {e.start_s:.0f} s"
                                            for n, e in Suite.engines.items()), file=sys.stderr)


def tearDownModule():
    for engine in Suite.engines.values():
        engine.stop()
    if Suite.kvtd is not None:
        Suite.kvtd.__exit__(None, None, None)
        Suite.kvtd = None


_salts = iter(range(1 << 30))


def plain(engine, prompt, max_tokens=GEN, logprobs=5):
    """A plain run: no reuse, and a cache salt of its own so it shares no prefix-cache blocks."""
    return engine.one(prompt, max_tokens, kvt={"reuse": "forbid"},
                      cache_salt=f"plain-{next(_salts)}", logprobs=logprobs)


_model = {}


def hf_model():
    """Model A through transformers (fp32): the reference the engines are checked against."""
    if "A" not in _model:
        from transformers import AutoModelForCausalLM

        _model["A"] = AutoModelForCausalLM.from_pretrained(Suite.dirs[A],
                                                           dtype=torch.float32).eval()
    return _model["A"]


def hf_cache(prompt):
    """transformers' cache of `prompt` on model A, as a kvt.KVCache (fp32, HND)."""
    with torch.no_grad():
        out = hf_model()(input_ids=torch.tensor([prompt]), use_cache=True)
    return adapters.from_dynamic_cache(out.past_key_values, dtype="fp32")


def client():
    return kvt.Client(Suite.kvtd.address, timeout=60)


class Qwen3IdentityTest(unittest.TestCase):
    maxDiff = None

    @classmethod
    def setUpClass(cls):
        cls.engine = Suite.engines["A"]
        cls.reference = plain(cls.engine, PROMPT)

    def assert_like_reference(self, r):
        self.assertEqual(r["token_ids"], self.reference["token_ids"])
        for got, want in zip(r["logprobs"], self.reference["logprobs"]):
            for token, value in want.items():
                self.assertAlmostEqual(got[token], value, places=3)

    def publish_twin_from_python(self):
        # The same tokens published again are the same entry: no exclusion of known ids.
        with client() as c:
            PrefixCache(c).publish(TWIN, PROMPT, hf_cache(PROMPT))
            family.wait_for_entries(c, TWIN, PROMPT)

    def run_salted(self, salt, kvt_params, prompt=PROMPT):
        return self.engine.one(prompt, GEN, cache_salt=f"q3-{salt}-{next(_salts)}",
                               logprobs=5, kvt=kvt_params)

    def test_plain_engine_equals_transformers(self):
        """The engine itself computes what transformers computes on these weights (the
        architecture is loaded as Qwen3, QK-norm and head_dim included)."""
        with torch.no_grad():
            logits = hf_model()(input_ids=torch.tensor([PROMPT])).logits[0, -1]
        logp = torch.log_softmax(logits.double(), dim=-1)
        self.assertEqual(self.reference["token_ids"][0], int(torch.argmax(logp)))
        for token, value in self.reference["logprobs"][0].items():
            self.assertAlmostEqual(value, float(logp[int(token)]), places=2)

    def test_python_publish_through_the_identity_equals_a_plain_run(self):
        self.publish_twin_from_python()
        for load, transport in (("auto", "in_place"), ("region", "shm"), ("inline", "inline")):
            r = self.run_salted(f"py-{load}", {"mapper_id": "twin-to-A", "load": load})
            o = outcome(r)
            self.assertEqual(o.get("outcome"), "applied", o)
            self.assertEqual(o["transport"], transport, o)
            self.assertEqual(o["source_model"], TWIN)
            self.assertEqual(o["tokens_reused"], (len(PROMPT) - 1) // 32 * 32)
            self.assertEqual(r["num_cached_tokens"], o["tokens_reused"])
            self.assert_like_reference(r)

    def test_twin_engine_publish_through_the_identity_equals_a_plain_run(self):
        """Two engines with the connector: T serves the prompt and publishes; A reuses it."""
        T = Suite.engines["T"]
        prompt = list(b"Engine to engine: ") + PROMPT[:200]
        want = plain(self.engine, prompt)
        with client() as c:
            before = family.entry_ids(c, TWIN)
            T.one(prompt, 2, kvt={"reuse": "forbid"}, cache_salt=f"q3-T-{next(_salts)}")
            family.wait_for_entries(c, TWIN, prompt, exclude=before)
        r = self.run_salted("engine", {"mapper_id": "twin-to-A"}, prompt)
        o = outcome(r)
        self.assertEqual(o.get("outcome"), "applied", o)
        self.assertEqual(o["source_model"], TWIN)
        self.assertEqual(o["tokens_reused"], (len(prompt) - 1) // 32 * 32)
        self.assertEqual(r["token_ids"], want["token_ids"])
        for got, ref in zip(r["logprobs"], want["logprobs"]):
            for token, value in ref.items():
                self.assertAlmostEqual(got[token], value, places=3)
        print(f"\nengine T -> A through the identity: {o['tokens_reused']} tokens reused; "
              f"timings {o['timings']}", file=sys.stderr)

    def test_zeroed_values_change_the_output(self):
        self.publish_twin_from_python()
        r = self.run_salted("zero", {"mapper_id": "twin-to-A-zero-v"})
        self.assertEqual(outcome(r).get("outcome"), "applied", outcome(r))
        self.assertNotEqual(r["logprobs"], self.reference["logprobs"])

    def test_engine_publish_is_its_own_cache(self):
        prompt = list(b"Shared memory publish: ") + PROMPT[:150]
        with client() as c:
            known = family.entry_ids(c, A)
            self.engine.one(prompt, 2, kvt={"reuse": "forbid"}, cache_salt="q3-pub")
            family.wait_for_entries(c, A, prompt, exclude=known)
            hit = PrefixCache(c).lookup(TWIN, prompt, mapper_id="A-to-twin",
                                        max_tokens=len(prompt) - 1, policy="force")
            self.assertTrue(hit.hit, hit)
            got = c.translate_cached(hit.lease_id, hit.mapper_id, hit.matched_tokens,
                                     dtype=DTYPE_NAMES[hit.dtype], output_dtype="fp32").target
        want = hf_cache(prompt).to_layout("NHD")
        got = got.to_layout("NHD")
        n = hit.matched_tokens
        self.assertGreater(n, 0)
        self.assertEqual(got.num_layers, want.num_layers)
        for layer in range(want.num_layers):
            for ours, theirs in ((got.k[layer], want.k[layer]), (got.v[layer], want.v[layer])):
                self.assertEqual(np.asarray(ours).shape[1:], (2, 128))
                np.testing.assert_allclose(np.asarray(ours)[:n], np.asarray(theirs)[:n],
                                           rtol=1e-3, atol=1e-3)


def neox_rope(x, theta):
    """x [1, heads, T, d] rotated (neox: halves) to positions 0..T-1 at `theta`, in float64."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    angles = torch.arange(x.shape[2], dtype=torch.float64)[:, None] * inv[None]
    cos = torch.cat([angles.cos(), angles.cos()], -1)
    sin = torch.cat([angles.sin(), angles.sin()], -1)
    x = x.double()
    rotated = torch.cat([-x[..., d // 2:], x[..., :d // 2]], -1)
    return x * cos + rotated * sin


class Qwen3ContentSpaceTest(unittest.TestCase):
    """kvtd strips the source's RoPE (neox, theta 1e6, all 128 dimensions) to the keys Qwen3
    computes before rotating them (after k_norm), and applies the target's."""

    def test_strip_gives_the_pre_rope_keys(self):
        from transformers.models.qwen3 import modeling_qwen3

        prompt = PROMPT[:160]
        captured = []
        original = modeling_qwen3.apply_rotary_pos_emb

        def hooked(q, k, *args, **kwargs):
            captured.append(k.detach().clone())
            return original(q, k, *args, **kwargs)

        modeling_qwen3.apply_rotary_pos_emb = hooked
        try:
            cache = hf_cache(prompt)
        finally:
            modeling_qwen3.apply_rotary_pos_emb = original
        self.assertEqual(len(captured), cache.num_layers)
        with client() as c:
            got = c.translate(cache, mapper_id="A-rope-probe", output_dtype="fp32").target
        got = got.to_layout("HND")
        for layer, pre in enumerate(captured):
            want = neox_rope(pre, PROBE_THETA)[0].numpy()
            np.testing.assert_allclose(np.asarray(got.k[layer]), want, rtol=1e-3, atol=2e-3)
            np.testing.assert_allclose(np.asarray(got.v[layer]),
                                       np.asarray(cache.to_layout("HND").v[layer]),
                                       rtol=1e-5, atol=1e-5)
        # The probe fails on a wrong strip: the keys as cached (rotated at 1e6) are far off.
        far = np.abs(np.asarray(got.k[0]) - np.asarray(cache.to_layout("HND").k[0])).max()
        self.assertGreater(far, 0.1)


class Qwen3AdaptersTest(unittest.TestCase):
    """The HF adapters on Qwen3: a cache translated by kvtd (the identity), turned into a
    transformers DynamicCache, continues the prompt exactly as a full forward pass does."""

    def test_translated_cache_continues_like_a_full_forward(self):
        split = 128
        model = hf_model()
        with torch.no_grad():
            full = model(input_ids=torch.tensor([PROMPT])).logits[0, split:]
        with client() as c:
            got = c.translate(hf_cache(PROMPT[:split]), mapper_id="twin-to-A",
                              output_dtype="fp32").target
        layers = adapters.to_legacy_cache(got, dtype=torch.float32)
        self.assertEqual(tuple(layers[0][0].shape), (1, 2, split, 128))
        dyn = adapters.to_dynamic_cache(got, dtype=torch.float32, config=model.config)
        with torch.no_grad():
            out = model(input_ids=torch.tensor([PROMPT[split:]]), past_key_values=dyn,
                        use_cache=True).logits[0]
        np.testing.assert_allclose(out.numpy(), full.numpy(), rtol=1e-3, atol=1e-3)
        # And back: the DynamicCache holds the prefix plus the continuation.
        back = adapters.from_dynamic_cache(dyn, dtype="fp32")
        self.assertEqual(back.num_tokens, len(PROMPT))


class Qwen3FitTest(unittest.TestCase):
    """tools/dump_kv.py + `kvt fit` on the tiny Qwen3 pair (run in setUpModule), served by kvtd."""

    def manifest(self, key):
        with open(os.path.join(Suite.fitted[key], "manifest.yaml")) as f:
            return yaml.safe_load(f)

    def test_fitted_manifest_has_the_models_shapes_and_rope(self):
        m = self.manifest("A-to-B")
        self.assertEqual(m["source"]["name"], A)
        self.assertEqual(m["target"]["name"], B)
        for side, name in (("source", A), ("target", B)):
            layers, _, _, heads, dim, _ = Q.SHAPES[name]
            self.assertEqual(m[side]["num_layers"], layers)
            self.assertEqual(m[side]["num_kv_heads"], heads)
            self.assertEqual(m[side]["head_dim"], dim)
            rope = m[side]["rope"]
            self.assertEqual((float(rope["theta"]), rope["rotary_dim"], rope["style"]),
                             (Q.ROPE_THETA, 128, "neox"))
        self.assertEqual(len(m["layers"]), Q.SHAPES[B][0])

    def test_kvtd_serves_the_fitted_and_the_synthesised_pair(self):
        cache = hf_cache(PROMPT[:96])
        for mapper in ("fit-A-to-B", Q.mapper_id(A, B)):
            with client() as c:
                got = c.translate(cache, mapper_id=mapper, output_dtype="fp32")
            t = got.target.to_layout("HND")
            self.assertEqual(t.num_layers, Q.SHAPES[B][0], mapper)
            self.assertEqual(np.asarray(t.k[0]).shape, (2, 96, 128), mapper)
            self.assertTrue(all(np.isfinite(np.asarray(x)).all() for x in t.k + t.v), mapper)

    def test_fit_of_a_model_onto_itself_is_nearly_the_identity(self):
        m = self.manifest("A-to-twin")
        for layer in m["layers"]:
            self.assertEqual(layer["sigma_k"], [layer["target_layer"]], layer)
            self.assertGreater(layer["r2_k_heldout"], 0.99, layer)
            self.assertGreater(layer["r2_v_heldout"], 0.99, layer)
        cache = hf_cache(PROMPT[:128])
        with client() as c:
            got = c.translate(cache, mapper_id="fit-A-to-twin", output_dtype="fp32").target
        got, want = got.to_layout("HND"), cache.to_layout("HND")
        for layer in range(want.num_layers):
            for ours, theirs in ((got.k[layer], want.k[layer]), (got.v[layer], want.v[layer])):
                ours, theirs = np.asarray(ours), np.asarray(theirs)
                rel = np.linalg.norm(ours - theirs) / np.linalg.norm(theirs)
                self.assertLess(rel, 0.05, f"layer {layer}")


if __name__ == "__main__":
    unittest.main(verbosity=2)
