"""The committed family: each member loads with transformers' LlamaForCausalLM (HF key names and
config.json), and its logits and KV cache equal those of model.py (the training code) on fresh
random bytes; the matched members share num_key_value_heads and head_dim, the unmatched one does
not; every member beats the unigram level on held-out text (summary.json) and uses its context up
to the declared max_position_embeddings."""

import json
import os
import sys
import unittest

try:
    import torch
    from transformers import LlamaForCausalLM
except ImportError as e:
    sys.exit(f"family_test: {e} (python {sys.executable}): run scripts/bootstrap.sh --python "
             "and put .venv/bin first on PATH, as scripts/test.sh does")

import dump_kv  # tools/dump_kv.py
import model as tiny
import position_curve

HERE = os.path.dirname(os.path.abspath(__file__))

MODELS = os.path.join(HERE, "models")
MATCHED = ["S", "M", "L"]
UNMATCHED = ["U"]


class FamilyTest(unittest.TestCase):
    def config(self, name):
        with open(os.path.join(MODELS, name, "config.json")) as f:
            return json.load(f)

    def test_transformers_computes_what_the_training_code_computes(self):
        torch.manual_seed(1234)
        for name in MATCHED + UNMATCHED:
            with self.subTest(member=name):
                ours = tiny.load(os.path.join(MODELS, name)).eval()
                hf = LlamaForCausalLM.from_pretrained(os.path.join(MODELS, name),
                                                      dtype=torch.float32).eval()
                ids = torch.randint(0, tiny.VOCAB, (2, 77))
                with torch.no_grad():
                    logits, kv = ours(ids, return_kv=True)
                    out = hf(input_ids=ids, use_cache=True)
                    ref = out.logits.double()
                self.assertLess((logits.double() - ref).abs().max().item(),
                                1e-4 * max(1.0, ref.abs().max().item()))
                cache = dump_kv.legacy_cache(out.past_key_values)  # DynamicLayer keys/values
                self.assertEqual(len(cache), len(kv))
                for (k, v), (hk, hv) in zip(kv, cache):
                    self.assertLess((k - hk).abs().max().item(), 1e-4)
                    self.assertLess((v - hv).abs().max().item(), 1e-4)

    def test_shapes_of_the_family(self):
        kv = {(c["num_key_value_heads"], c["hidden_size"] // c["num_attention_heads"])
              for c in map(self.config, MATCHED)}
        self.assertEqual(len(kv), 1, "matched members must share the KV shape")
        for name in UNMATCHED:
            c = self.config(name)
            self.assertNotIn((c["num_key_value_heads"],
                              c["hidden_size"] // c["num_attention_heads"]), kv)
        layers = [self.config(n)["num_hidden_layers"] for n in MATCHED]
        widths = [self.config(n)["hidden_size"] for n in MATCHED]
        self.assertEqual(len(set(zip(layers, widths))), len(MATCHED))

    def test_declared_context_is_covered(self):
        # Every member declares the context it was trained on (engines refuse longer prompts)
        # and still uses context at its end: the 64 bytes ending there score better after the
        # whole window than after only the 64 bytes before them (README.md, "Context").
        stream = position_curve.heldout_stream()
        for name in MATCHED + UNMATCHED:
            with self.subTest(member=name):
                declared = self.config(name)["max_position_embeddings"]
                self.assertEqual(declared, tiny.DECLARED_CONTEXT)
                long, short = position_curve.long_vs_short(os.path.join(MODELS, name), stream,
                                                           32, declared)
                self.assertLess(long, short)

    def test_summaries(self):
        for name in MATCHED + UNMATCHED:
            with open(os.path.join(MODELS, name, "summary.json")) as f:
                s = json.load(f)
            # Byte frequencies of the training split score 4.89 bits per byte on the held-out
            # split (bigram: 3.83); every member must at least beat the unigram model.
            self.assertLess(s["heldout_bits_per_byte"], 4.5, name)
            if name != "L":
                self.assertTrue(s["teacher"].endswith("/L"), name)


if __name__ == "__main__":
    unittest.main(verbosity=2)
