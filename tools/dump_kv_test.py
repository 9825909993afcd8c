#!/usr/bin/env python3
"""Tests of tools/dump_kv.py. The corpus and window logic always run; the model part runs a tiny
randomly initialised Llama (no downloads) when torch and transformers are importable, checks the
dump format and that keys are post-RoPE, and fits a mapper from two such models with `kvt fit`.
torch and transformers come from the project venv (scripts/bootstrap.sh --python; scripts/test.sh
puts it first on PATH); without them the test fails, it never skips."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import dump_kv

HERE = os.path.dirname(os.path.abspath(__file__))

try:
    import torch  # noqa: F401
    import transformers  # noqa: F401
except ImportError as e:
    sys.exit(f"dump_kv_test: {e} (python {sys.executable}): run scripts/bootstrap.sh --python "
             "and put .venv/bin first on PATH, as scripts/test.sh does")


def read_header(path):
    """{"__metadata__": {...}, name: {"dtype", "shape"}} of a safetensors file, through the
    safetensors package (what any reader of the dumps sees)."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        header = {"__metadata__": f.metadata()}
        for name in f.keys():
            piece = f.get_slice(name)
            header[name] = {"dtype": piece.get_dtype(), "shape": list(piece.get_shape())}
    return header


def kvt_binary():
    srcdir = os.environ.get("TEST_SRCDIR")
    if srcdir and os.path.exists(os.path.join(srcdir, "kvt", "cli", "kvt")):
        return os.path.join(srcdir, "kvt", "cli", "kvt")
    candidate = os.path.join(HERE, "..", "bazel-bin", "cli", "kvt")
    return candidate if os.path.exists(candidate) else None


class CorpusTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))

    def tearDown(self):
        shutil.rmtree(self.dir)

    def test_txt_documents_split_on_blank_lines(self):
        path = os.path.join(self.dir, "c.txt")
        with open(path, "w") as f:
            f.write("one\ntwo\n\n\nthree\n")
        self.assertEqual(list(dump_kv.read_documents(path, "text")), ["one\ntwo\n", "three\n"])

    def test_jsonl_field_and_errors(self):
        path = os.path.join(self.dir, "c.jsonl")
        with open(path, "w") as f:
            f.write('{"text": "a"}\n\n{"body": "b", "text": "c"}\n')
        self.assertEqual(list(dump_kv.read_documents(path, "text")), ["a", "c"])
        with open(path, "w") as f:
            f.write('{"text": "a"}\n{"body": "b"}\n')
        with self.assertRaisesRegex(SystemExit, "line 2: no string field 'text'"):
            list(dump_kv.read_documents(path, "text"))

    def test_windows_are_consecutive_and_capped(self):
        stream = iter([[1, 2, 3], [4, 5], [6, 7, 8, 9, 10]])
        self.assertEqual(list(dump_kv.windows(stream, 4, 2)), [[1, 2, 3, 4], [5, 6, 7, 8]])

    def test_spread_windows_cover_the_corpus_end_to_end(self):
        docs = [list(range(i * 10, i * 10 + 10)) for i in range(10)]  # 100 tokens, 25 windows

        def spread(count):
            return list(dump_kv.spread_windows(lambda: iter(docs), 4, count))
        picked = spread(3)
        self.assertEqual(picked, [[0, 1, 2, 3], [48, 49, 50, 51], [96, 97, 98, 99]])
        self.assertEqual(len(spread(24)), 24)
        self.assertEqual(len({tuple(w) for w in spread(24)}), 24)
        self.assertEqual(spread(1), [[0, 1, 2, 3]])
        every = list(dump_kv.windows(iter(docs), 4, 25))
        self.assertEqual(spread(25), every)
        self.assertEqual(spread(40), every)  # a corpus short of windows gives all it has

    def test_byte_tokenizer(self):
        self.assertEqual(dump_kv.ByteTokenizer().encode("hé"), [104, 195, 169])


class TinyLlamaTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(dir=os.environ.get("TEST_TMPDIR"))
        self.corpus = os.path.join(self.dir, "corpus.txt")
        with open(self.corpus, "w") as f:
            for i in range(40):
                f.write(f"Paragraph {i}: the quick brown fox jumps over the lazy dog {i * 7}.\n\n")

    def tearDown(self):
        shutil.rmtree(self.dir)

    def make_model(self, name, layers, kv_heads, head_dim, theta, seed):
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(seed)
        config = LlamaConfig(vocab_size=256, hidden_size=kv_heads * 2 * head_dim,
                             intermediate_size=64, num_hidden_layers=layers,
                             num_attention_heads=kv_heads * 2, num_key_value_heads=kv_heads,
                             head_dim=head_dim, rope_theta=theta, max_position_embeddings=256)
        model = LlamaForCausalLM(config)
        path = os.path.join(self.dir, name)
        model.save_pretrained(path)
        return path, model

    def dump(self, model_path, out, **flags):
        argv = ["--model", model_path, "--corpus", self.corpus, "--out", out, "--tokens", "32",
                "--sequences", "6", "--dtype", "fp32", "--tokenizer", "bytes"]
        for key, value in flags.items():
            argv += [f"--{key}", str(value)] if value != "" else [f"--{key}"]
        self.assertEqual(dump_kv.main(argv), 0)

    def test_read_safetensors_inverts_write(self):
        tensors = {"a": torch.randn(3, 5), "b": torch.randn(2, 4).to(torch.bfloat16),
                   "c": torch.randn(7).to(torch.float16)}
        path = os.path.join(self.dir, "t.safetensors")
        dump_kv.write_safetensors(path, tensors, {"format": "pt"})
        back = dump_kv.read_safetensors(path)
        self.assertEqual(sorted(back), ["a", "b", "c"])
        for name, tensor in tensors.items():
            self.assertEqual(back[name].dtype, tensor.dtype)
            self.assertTrue(torch.equal(back[name], tensor), name)

    def test_dump_format_and_post_rope_keys(self):
        path, model = self.make_model("small", 2, 2, 16, 10000.0, 1)
        out = os.path.join(self.dir, "dumps")
        self.dump(path, out)
        files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
        self.assertEqual(len(files), 6)
        header = read_header(os.path.join(out, files[0]))
        self.assertEqual(header["__metadata__"]["rope"], "post")
        self.assertEqual(header["__metadata__"]["position_stride"], "1")
        self.assertEqual(header["layers.1.v"]["shape"], [2, 32, 16])
        self.assertEqual(header["layers.0.k"]["dtype"], "F32")
        self.assertTrue(os.path.exists(os.path.join(out, "config.json")))

        # Layer 0 keys: k_proj(input_layernorm(embedding)). At position 0 RoPE is the identity;
        # later positions are rotated (same norm per head, different values).
        ids = dump_kv.ByteTokenizer().encode(dump_kv.read_documents(self.corpus, "").__next__())
        ids = ids[:32]
        layer = model.model.layers[0]
        with torch.no_grad():
            hidden = layer.input_layernorm(model.model.embed_tokens(torch.tensor([ids])))
            raw = layer.self_attn.k_proj(hidden)[0].view(32, 2, 16).transpose(0, 1)
        dumped = dump_kv.read_safetensors(os.path.join(out, files[0]))["layers.0.k"]
        self.assertEqual((dumped.dtype, tuple(dumped.shape)), (torch.float32, (2, 32, 16)))
        self.assertTrue(torch.allclose(dumped[:, 0], raw[:, 0], atol=1e-5))
        self.assertFalse(torch.allclose(dumped[:, 5], raw[:, 5], atol=1e-3))
        self.assertTrue(torch.allclose(dumped[:, 5].norm(dim=-1), raw[:, 5].norm(dim=-1),
                                       atol=1e-4))

    def test_queries_are_the_rotated_queries(self):
        from transformers.models.llama.modeling_llama import (LlamaRotaryEmbedding,
                                                              apply_rotary_pos_emb)
        path, model = self.make_model("small", 2, 2, 16, 10000.0, 1)
        out = os.path.join(self.dir, "dumps_q")
        self.dump(path, out, keep_every=2, queries="")
        files = sorted(f for f in os.listdir(out) if f.endswith(".safetensors"))
        tensors = dump_kv.read_safetensors(os.path.join(out, files[0]))
        self.assertEqual(list(tensors["queries.1"].shape), [4, 16, 16])  # 4 heads, 32 / 2 kept
        # Layer 0: RoPE(q_proj(input_layernorm(embedding))) at positions 0, 2, 4, ...
        ids = dump_kv.ByteTokenizer().encode(dump_kv.read_documents(self.corpus, "").__next__())
        ids = ids[:32]
        layer = model.model.layers[0]
        with torch.no_grad():
            hidden = layer.input_layernorm(model.model.embed_tokens(torch.tensor([ids])))
            q = layer.self_attn.q_proj(hidden).view(1, 32, 4, 16).transpose(1, 2)
            cos, sin = LlamaRotaryEmbedding(config=model.config)(q, torch.arange(32)[None])
            rotated, _ = apply_rotary_pos_emb(q, q, cos, sin)
        self.assertTrue(torch.allclose(tensors["queries.0"], rotated[0, :, ::2], atol=1e-5))
        # The hook is per run and KV readers ignore the extra tensors: kvt fit still reads them.
        self.assertEqual(list(tensors["layers.0.k"].shape), [2, 16, 16])

    def test_kvt_fit_kind_both_recommends_from_heldout_queries(self):
        binary = kvt_binary()
        self.assertIsNotNone(binary, "the kvt binary is not in the runfiles nor in bazel-bin")
        small, _ = self.make_model("small", 2, 2, 16, 10000.0, 1)
        large, _ = self.make_model("large", 3, 2, 16, 500000.0, 2)
        self.dump(small, os.path.join(self.dir, "d_small"))
        self.dump(large, os.path.join(self.dir, "d_large"), queries="")
        out = os.path.join(self.dir, "both")
        flags = [binary, "fit", f"--source_config={small}", f"--target_config={large}",
                 f"--source_dumps={os.path.join(self.dir, 'd_small')}",
                 f"--target_dumps={os.path.join(self.dir, 'd_large')}", f"--out={out}",
                 "--top_k=all", "--stride=1", "--lambda=0.1", "--heldout_fraction=0.4",
                 "--source_model=tiny/small", "--target_model=tiny/large", "--kind=both",
                 "--mlp_hidden=32", "--mlp_epochs=3", "--mlp_batch=64"]
        result = subprocess.run(flags, capture_output=True, text=True)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("recommended:", result.stdout)
        with open(os.path.join(out, "fit_report.json")) as f:
            report = json.load(f)
        self.assertIn(report["recommended"], ("ridge", "mlp"))
        for kind in ("ridge", "mlp"):
            self.assertTrue(os.path.exists(os.path.join(out, kind, "manifest.yaml")))
            self.assertTrue(-1.0 <= report[kind]["attention_cosine"] <= 1.0)
        better = max(("ridge", "mlp"), key=lambda k: report[k]["attention_cosine"])
        if abs(report["mlp"]["attention_cosine"] - report["ridge"]["attention_cosine"]) > 1e-4:
            self.assertEqual(report["recommended"], better)
        with open(os.path.join(out, "mlp", "manifest.yaml")) as f:
            self.assertIn("kind: mlp", f.read())
        # Without queries in the target dumps the comparison cannot be made: a named refusal.
        result = subprocess.run(
            [a.replace("d_large", "d_small").replace("target_config=" + large,
                                                      "target_config=" + small)
             for a in flags] + ["--overwrite"], capture_output=True, text=True)
        self.assertNotEqual(result.returncode, 0)
        self.assertIn("--queries", result.stderr)

    def test_kvt_fit_reads_the_dumps(self):
        binary = kvt_binary()
        self.assertIsNotNone(binary, "the kvt binary is not in the runfiles nor in bazel-bin")
        small, _ = self.make_model("small", 2, 2, 16, 10000.0, 1)
        large, _ = self.make_model("large", 3, 2, 16, 500000.0, 2)
        self.dump(small, os.path.join(self.dir, "d_small"), keep_every=2)
        self.dump(large, os.path.join(self.dir, "d_large"), keep_every=2)
        out = os.path.join(self.dir, "mapper")
        result = subprocess.run(
            [binary, "fit", f"--source_config={small}", f"--target_config={large}",
             f"--source_dumps={os.path.join(self.dir, 'd_small')}",
             f"--target_dumps={os.path.join(self.dir, 'd_large')}", f"--out={out}",
             "--top_k=all", "--stride=1", "--lambda=0.1", "--heldout_fraction=0.3",
             "--source_model=tiny/small", "--target_model=tiny/large"],
            capture_output=True, text=True)
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("mean R^2", result.stdout)
        self.assertTrue(os.path.exists(os.path.join(out, "manifest.yaml")))


if __name__ == "__main__":
    unittest.main(verbosity=2)
