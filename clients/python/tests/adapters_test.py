"""kvt.adapters: torch (K, V) tensors and Hugging Face DynamicCache to and from kvt.KVCache, and a
router handoff end to end: a tiny random Llama's DynamicCache (the real transformers code path)
translated by a real kvtd (demo-tiny), checked against the float64 reference, turned back into a
DynamicCache and used by the target Llama to continue. torch and transformers must be importable
(the project venv): a missing one fails this test."""

from __future__ import annotations

import os
import shutil
import sys
import unittest
from types import SimpleNamespace

import numpy as np
import torch
import transformers
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

import kvt
from kvt import adapters
from kvt_testing import junit_main
from kvt_testing.kvtd import Kvtd
from kvt_testing.runfiles import runfile, test_tmpdir
from reference import RidgeMapper, max_rel_error

# KVT_TEST_SEED (docs/TESTING.md) replays a run; unset, a fresh seed.
SEED = (int(os.environ["KVT_TEST_SEED"]) if os.environ.get("KVT_TEST_SEED")
        else int.from_bytes(os.urandom(4), "little"))
print(f"adapters_test: seed {SEED} (replay with KVT_TEST_SEED={SEED}), "
      f"torch {torch.__version__}, transformers {transformers.__version__}", file=sys.stderr)
torch.manual_seed(SEED)


def tiny_llama(layers: int) -> LlamaForCausalLM:
    # The demo-tiny shapes: 2 KV heads of head_dim 32 (hidden 128 / 4 query heads), RoPE theta
    # 10000 (neox), 4 source and 6 target layers.
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=1024, rope_theta=10000.0)
    return LlamaForCausalLM(config).eval()


class TorchAdapterTest(unittest.TestCase):
    def test_tensors_round_trip_exactly_in_every_dtype(self) -> None:
        for torch_dtype, wire in ((torch.bfloat16, "bf16"), (torch.float16, "fp16"),
                                  (torch.float32, "fp32")):
            layers = [(torch.randn(1, 3, 17, 8).to(torch_dtype),
                       torch.randn(1, 3, 17, 8).to(torch_dtype)) for _ in range(5)]
            cache = adapters.from_torch(layers)
            self.assertEqual((cache.dtype, cache.layout, cache.num_layers, cache.num_kv_heads,
                              cache.num_tokens, cache.head_dim), (wire, "HND", 5, 3, 17, 8))
            for layout in ("HND", "NHD"):
                back = adapters.to_torch(cache.to_layout(layout))
                for (k, v), (k2, v2) in zip(layers, back):
                    self.assertEqual(k2.dtype, torch_dtype)
                    self.assertTrue(torch.equal(k, k2) and torch.equal(v, v2))
            # The wire bytes of bf16 data are the tensor's own bits.
            if wire == "bf16":
                wire_bits = np.frombuffer(next(cache.packed()), dtype="<u2")
                torch_bits = layers[0][0].view(torch.int16).numpy().astype("<u2").ravel()
                np.testing.assert_array_equal(wire_bits, torch_bits)

    def test_bad_tensors(self) -> None:
        with self.assertRaises(kvt.InvalidArgumentError) as caught:
            adapters.from_torch([(torch.zeros(2, 3, 4, 8), torch.zeros(2, 3, 4, 8))])
        self.assertIn("layer 0 K", str(caught.exception))
        with self.assertRaises(kvt.InvalidArgumentError):
            adapters.from_torch([(torch.zeros(1, 3, 4, 8, dtype=torch.int32),) * 2])
        with self.assertRaises(kvt.InvalidArgumentError):
            adapters.from_dynamic_cache(object())

    def test_dynamic_cache_round_trip(self) -> None:
        layers = [(torch.randn(1, 2, 9, 32), torch.randn(1, 2, 9, 32)) for _ in range(3)]
        dynamic = adapters.to_dynamic_cache(adapters.from_torch(layers))
        self.assertIsInstance(dynamic, DynamicCache)
        self.assertEqual(dynamic.get_seq_length(), 9)
        self.assertEqual(len(adapters.dynamic_cache_layers(dynamic)), 3)
        # transformers 5 keeps a list of DynamicLayer objects with .keys / .values (no
        # key_cache / value_cache lists): the adapter reads those.
        self.assertEqual(type(dynamic.layers[0]).__name__, "DynamicLayer")
        self.assertTrue(torch.equal(dynamic.layers[2].values, layers[2][1]))
        back = adapters.from_dynamic_cache(dynamic)
        for layer, (k, v) in enumerate(layers):
            np.testing.assert_array_equal(back.k[layer], k[0].numpy())
            np.testing.assert_array_equal(back.v[layer], v[0].numpy())
        # The legacy tuple form reads the same, and to_legacy_cache writes it.
        legacy = tuple((k, v) for k, v in layers)
        np.testing.assert_array_equal(adapters.from_dynamic_cache(legacy).v[2], layers[2][1][0])
        written = adapters.to_legacy_cache(back)
        self.assertIsInstance(written, tuple)
        self.assertEqual(len(written), 3)
        for (k, v), (k2, v2) in zip(layers, written):
            self.assertTrue(torch.equal(k, k2) and torch.equal(v, v2))
        # Older transformers' key_cache / value_cache lists are still read.
        older = SimpleNamespace(key_cache=[k for k, _ in layers], value_cache=[v for _, v in layers])
        np.testing.assert_array_equal(adapters.from_dynamic_cache(older).k[1], layers[1][0][0])
        # A DynamicCache made with a config holds layers before any update: a named error.
        empty = DynamicCache(config=tiny_llama(2).config)
        with self.assertRaisesRegex(kvt.InvalidArgumentError, "hold no tensors"):
            adapters.from_dynamic_cache(empty)

    def test_legacy_tuple_past_key_values_through_the_adapter(self) -> None:
        # transformers 5 models reject a tuple past_key_values; as_dynamic_cache turns the
        # deprecated form into the DynamicCache they take, with the same continuation.
        model = tiny_llama(3)
        ids = torch.randint(0, 256, (1, 12))
        follow = torch.randint(0, 256, (1, 4))
        with torch.no_grad():
            prefill = model(ids, past_key_values=DynamicCache(), use_cache=True)
            legacy = adapters.to_legacy_cache(adapters.from_dynamic_cache(prefill.past_key_values))
            expected = model(follow, past_key_values=prefill.past_key_values, use_cache=True)
            self.assertIsInstance(legacy, tuple)
            cache = adapters.as_dynamic_cache(legacy, config=model.config)
            self.assertIsInstance(cache, DynamicCache)
            self.assertEqual(cache.get_seq_length(), 12)
            got = model(follow, past_key_values=cache, use_cache=True)
        self.assertTrue(torch.equal(got.logits, expected.logits))
        self.assertEqual(adapters.from_dynamic_cache(got.past_key_values).num_tokens, 16)
        # A Cache object (or None) passes through unchanged.
        self.assertIs(adapters.as_dynamic_cache(cache), cache)
        self.assertIsNone(adapters.as_dynamic_cache(None))


class HandoffTest(unittest.TestCase):
    """A DynamicCache from a real forward pass through kvtd and into the target model."""

    @classmethod
    def setUpClass(cls) -> None:
        store = os.path.join(test_tmpdir(), "store")
        shutil.rmtree(store, ignore_errors=True)
        shutil.copytree(os.path.dirname(runfile("demo/mappers/demo-tiny/manifest.yaml")),
                        os.path.join(store, "demo-tiny"))
        cls.kvtd = Kvtd(["--listen_address=127.0.0.1:0", f"--mapper_store={store}",
                         "--backend=cpu", "--cpu_threads=1",
                         "--drain_grace_seconds=0"]).__enter__()
        cls.mapper = RidgeMapper(os.path.join(store, "demo-tiny"))

    @classmethod
    def tearDownClass(cls) -> None:
        cls.kvtd.__exit__()

    def test_source_prefill_translated_and_continued_by_target(self) -> None:
        source_model, target_model = tiny_llama(4), tiny_llama(6)
        tokens = 40
        ids = torch.randint(0, 256, (1, tokens))
        with torch.no_grad():
            prefill = source_model(ids, past_key_values=DynamicCache(), use_cache=True)
        source = adapters.from_dynamic_cache(prefill.past_key_values)
        self.assertEqual((source.num_layers, source.num_tokens, source.dtype), (4, tokens, "fp32"))

        with kvt.Client(self.kvtd.address, timeout=60) as client:
            result = client.translate(source, source_model="kvt-demo/tiny-4l",
                                      target_model="kvt-demo/tiny-6l", session_id="s1", turn=1)
        expected_k, expected_v = self.mapper.translate(source.k, source.v, np.arange(tokens))
        for layer in range(6):
            self.assertLessEqual(max_rel_error(result.target.k[layer], expected_k[layer]), 1e-5)
            self.assertLessEqual(max_rel_error(result.target.v[layer], expected_v[layer]), 1e-5)

        translated = adapters.to_dynamic_cache(result.target, config=target_model.config)
        self.assertEqual(translated.get_seq_length(), tokens)
        follow = torch.randint(0, 256, (1, 5))
        with torch.no_grad():
            out = target_model(follow, past_key_values=translated, use_cache=True,
                               position_ids=torch.arange(tokens, tokens + 5)[None])
        self.assertEqual(tuple(out.logits.shape), (1, 5, 256))
        self.assertTrue(torch.isfinite(out.logits).all())
        # The target appended its own 5 tokens after the translated 40, in every layer.
        grown = adapters.from_dynamic_cache(out.past_key_values)
        self.assertEqual((grown.num_layers, grown.num_tokens), (6, tokens + 5))
        np.testing.assert_array_equal(grown.k[5][:, :tokens], result.target.k[5])


if __name__ == "__main__":
    junit_main.main()
