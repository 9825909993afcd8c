"""kvt.qualify (`python -m kvt.qualify`) cross-checked against the evaluation harness on the
bundled family: a real ridge mapper (tools/dump_kv.py dumps, `kvt fit`) and an identity mapper
served by a real kvtd, the target and source through transformers.

- On the held-out documents (written as a .jsonl text file, as an operator gives their own
  text), kvt.qualify's benefit recovered, CE per condition and KL equal retention.evaluate_pair's
  on the same windows (heldout_windows), its interval eval/intervals.benefit_interval's; its own
  CE also equals the target's plain forward pass over context + continuation (no cache).
- An identity mapper from the target to itself recovers the whole benefit with a KL of ~0,
  through the command line (--out JSON, the summary table).
- The refusals name the flag: too few windows, context over max_position_embeddings, source and
  target tokenizers that differ, a text the target gains nothing from context on.
- --record writes the figures through `kvt record-benefit`; a refused record fails naming it.
"""

import json
import os
import subprocess
import sys
import time
import unittest

import numpy as np
import torch
import yaml

import intervals
import kvt
import retention as R
from kvt import qualify
from kvt_testing import identity_mappers
from kvt_testing.runfiles import runfile

# M (distilled from L) -> L, as the CI subset of the evaluation (retention_ci_test).
SOURCE, TARGET, K = "M", "L", "2"
CALIB_WINDOWS, CALIB_TOKENS = 24, 128
WINDOWS, CONTEXT, CONTINUATION = 8, 64, 16


def identity_mapper(store, member):
    """An identity mapper (k = 1, W = I) from `member` to itself."""
    with open(os.path.join(member.dir, "config.json")) as f:
        theta = float(json.load(f).get("rope_theta", 10000.0))
    return identity_mappers.write(
        os.path.join(store, "identity"), source_name=member.name, target_name=member.name,
        layers=member.layers, heads=member.n_kv, dim=member.head_dim, source_theta=theta,
        target_theta=theta, zero_v=False, created_by="eval/qualify_test.py")


def hf_tokenizer(out, vocab):
    """A word-level Hugging Face tokenizer (tokenizer.json + tokenizer_config.json) in `out`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>",
                            eos_token="<eos>").save_pretrained(out)
    return out


class QualifyTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        torch.set_num_threads(1)
        cls.work = os.environ.get("TEST_TMPDIR") or "/tmp/kvt-qualify-test"
        os.makedirs(cls.work, exist_ok=True)
        calib = R.write_split("calib", os.path.join(cls.work, "calib.jsonl"))
        cls.heldout = R.write_split("heldout", os.path.join(cls.work, "heldout.jsonl"))
        cls.source = R.Member(os.path.join(R.MODELS, SOURCE))
        cls.target = R.Member(os.path.join(R.MODELS, TARGET))
        dumps = {key: R.dump(member.dir, calib, os.path.join(cls.work, "dumps", key),
                             CALIB_TOKENS, CALIB_WINDOWS)
                 for key, member in (("s", cls.source), ("t", cls.target))}
        cls.store = os.path.join(cls.work, "store")
        R.fit(dumps["s"], dumps["t"], cls.source.name, cls.target.name, K,
              os.path.join(cls.store, "ridge"))
        identity_mapper(cls.store, cls.target)
        cls.server = R.start_kvtd(cls.store).__enter__()

    @classmethod
    def tearDownClass(cls):
        cls.server.__exit__(None, None, None)

    def run_qualify(self, mapper_id, source, **flags):
        return qualify.qualify(self.server.address, mapper_id, source.dir, self.target.dir,
                               [("heldout", self.heldout)], tokenizer="bytes",
                               **{"windows": WINDOWS, "context": CONTEXT,
                                  "continuation": CONTINUATION, **flags})

    def main_fails(self, argv):
        """kvt.qualify's main on argv: its exit status and what it wrote to stderr."""
        import contextlib
        import io

        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            status = qualify.main(argv)
        return status, err.getvalue()

    def common_flags(self, mapper_id="ridge"):
        return [f"--kvtd={self.server.address}", f"--mapper_id={mapper_id}",
                f"--source_model={self.source.dir}", f"--target_model={self.target.dir}",
                f"--text=heldout={self.heldout}", "--tokenizer=bytes"]

    def test_equals_the_evaluation_harness(self):
        start = time.monotonic()
        result = self.run_qualify("ridge", self.source)
        seconds = time.monotonic() - start
        entry, = result["benefit"]
        print(f"\nqualify_test: {WINDOWS} windows of {CONTEXT}+{CONTINUATION}, ridge "
              f"{SOURCE}->{TARGET}: {seconds:.1f} s (models loaded included); "
              f"{json.dumps(entry)}", file=sys.stderr)
        windows = R.heldout_windows(CONTEXT + CONTINUATION + 1, WINDOWS)
        with kvt.Client(self.server.address, timeout=120) as client:
            ref = R.evaluate_pair(client, self.source, self.target, "ridge", windows, CONTEXT, {})
        self.assertEqual((entry["text"], entry["windows"], entry["context_tokens"],
                          entry["continuation_tokens"]),
                         ("heldout", WINDOWS, CONTEXT, CONTINUATION))
        self.assertEqual((ref["windows"], ref["continuation"]), (WINDOWS, CONTINUATION))
        self.assertAlmostEqual(entry["recovered"], ref["benefit"]["mapped"]["all"], delta=1e-6)
        for key in ("own", "none", "mapped"):
            self.assertAlmostEqual(entry["ce_" + key], ref["ce"][key]["all"], delta=1e-6)
        self.assertAlmostEqual(entry["kl"], ref["kl"]["mapped"]["all"], delta=1e-6)
        # The evaluation's interval, from its per-window CE (rounded to 1e-7 nats there).
        _, low, high = intervals.benefit_interval(ref["per_window"]["ce"], "mapped")
        self.assertAlmostEqual(entry["lower95"], min(low, entry["recovered"]), delta=1e-5)
        self.assertAlmostEqual(entry["upper95"], max(high, entry["recovered"]), delta=1e-5)
        self.assertLessEqual(entry["lower95"], entry["recovered"])
        self.assertLessEqual(entry["recovered"], entry["upper95"])
        # Independently of any cache: own's CE from one forward pass over context + continuation.
        nll = []
        for ids in windows:
            with torch.no_grad():
                logits = self.target.hf(input_ids=torch.tensor([ids[:-1]])).logits[0, CONTEXT:]
            logp = torch.log_softmax(logits.double(), -1)
            nll.append(-logp.gather(1, torch.tensor(ids[CONTEXT + 1:])[:, None]).numpy())
        self.assertAlmostEqual(entry["ce_own"], float(np.mean(nll)), delta=1e-5)
        # A real mapper recovers some of the benefit, not all (the held-out text is in-domain).
        self.assertGreater(entry["recovered"], 0.0)
        self.assertLess(entry["recovered"], 1.0)
        self.assertGreater(entry["kl"], 0.0)

    def test_identity_recovers_everything_through_the_command_line(self):
        out = os.path.join(self.work, "identity.json")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        flags = self.common_flags("identity")
        flags[2] = f"--source_model={self.target.dir}"  # the target translated to itself
        done = subprocess.run([sys.executable, "-m", "kvt.qualify"] + flags +
                              [f"--windows={WINDOWS}", f"--context={CONTEXT}",
                               f"--continuation={CONTINUATION}", f"--out={out}",
                               "--device=cpu", "--threads=1"],
                              capture_output=True, text=True, env=env)
        self.assertEqual(done.returncode, 0, done.stdout + done.stderr)
        self.assertIn("worst lower95", done.stdout)
        with open(out) as f:
            result = json.load(f)
        self.assertEqual((result["mapper_id"], result["target_model"]),
                         ("identity", self.target.dir))
        entry, = result["benefit"]
        self.assertIn("heldout", done.stdout)
        self.assertEqual(set(entry), set(qualify.RECORD_KEYS) |
                         {"ce_own", "ce_none", "ce_mapped", "seconds"})
        self.assertAlmostEqual(entry["recovered"], 1.0, delta=1e-4)
        self.assertAlmostEqual(entry["lower95"], 1.0, delta=1e-4)
        self.assertAlmostEqual(entry["upper95"], 1.0, delta=1e-4)
        self.assertLess(entry["kl"], 1e-6)
        self.assertGreater(entry["ce_none"] - entry["ce_own"], 0.1)

    def test_too_few_windows(self):
        status, err = self.main_fails(self.common_flags() + ["--windows=100000",
                                                             f"--context={CONTEXT}",
                                                             f"--continuation={CONTINUATION}"])
        self.assertEqual(status, 2)
        self.assertRegex(err, r"--text=heldout=.*fewer than --windows=100000")

    def test_context_over_max_position_embeddings(self):
        limit = self.target.config.max_position_embeddings  # what the family declares
        context = limit - 8
        status, err = self.main_fails(self.common_flags() + [f"--context={context}",
                                                             "--continuation=16"])
        self.assertEqual(status, 2)
        self.assertIn(f"--context={context} + --continuation=16: {limit + 8} positions, more "
                      f"than --target_model's max_position_embeddings {limit}", err)

    def test_bad_device(self):
        status, err = self.main_fails(self.common_flags() + ["--device=abacus"])
        self.assertEqual(status, 2)
        self.assertIn("--device=abacus: ", err)

    def test_tokenizers_that_differ_are_refused(self):
        words = ["the", "a", "of", "and", "to", "in"]
        a = {"<eos>": 0, "<unk>": 1, **{w: i + 2 for i, w in enumerate(words)}}
        b = {"<eos>": 0, "<unk>": 1, **{w: i + 2 for i, w in enumerate(reversed(words))}}
        ta = hf_tokenizer(os.path.join(self.work, "tok_a"), a)
        tb = hf_tokenizer(os.path.join(self.work, "tok_b"), b)
        tc = hf_tokenizer(os.path.join(self.work, "tok_c"), dict(a))
        self.assertEqual(qualify.load_tokenizer("auto", tc, ta).encode("the end"), [2, 1])
        with self.assertRaisesRegex(qualify.QualifyError,
                                    r"--tokenizer=auto: the source's tokenizer .*tok_b.* and "
                                    r"the target's .*tok_a.* differ"):
            qualify.load_tokenizer("auto", tb, ta)

    def test_no_benefit_to_recover_is_refused(self):
        flat = {"own": [1.0, 1.2, 0.9], "none": [1.0, 1.1, 1.0], "mapped": [1.0, 1.1, 1.0]}
        with self.assertRaisesRegex(qualify.QualifyError,
                                    "--text=flat: the target gains nothing from context"):
            qualify.benefit_entry("flat", flat, 0.0, CONTEXT, CONTINUATION)

    def test_bad_text_names_and_files(self):
        status, err = self.main_fails(self.common_flags()[:4] + ["--text=a b=/x"])
        self.assertEqual(status, 2)
        self.assertIn("--text=a b=...: a text name is letters", err)
        bad = os.path.join(self.work, "bad.jsonl")
        with open(bad, "w") as f:
            f.write('{"text": "fine"}\n{"body": "no text"}\n')
        with self.assertRaisesRegex(qualify.QualifyError, r"--text=bad=.*line 2: no string"):
            qualify.text_windows("bad", bad, qualify.ByteTokenizer(), 2, 4, 4)

    def test_record(self):
        # `kvt record-benefit` writes quality.benefit into the manifest, and the mapper still
        # loads with its checksums verified (kvt inspect); a refused record fails naming it.
        result = {"mapper_id": "x", "source_model": "s", "target_model": "t", "benefit": [
            {"text": "heldout", "windows": 8, "context_tokens": 64, "continuation_tokens": 16,
             "recovered": 0.5, "lower95": 0.4, "upper95": 0.6, "kl": 0.1, "ce_own": 1.0,
             "ce_none": 1.4, "ce_mapped": 1.2, "seconds": 3.0}]}
        document = qualify.record_document(result)
        self.assertEqual(list(document), ["benefit"])
        self.assertEqual(list(document["benefit"][0]), list(qualify.RECORD_KEYS))
        binary = runfile("cli/kvt")
        mapper = os.path.join(self.work, "record_mapper")
        identity_mapper(mapper, self.target)
        mapper = os.path.join(mapper, "identity")
        qualify.record(result, mapper, binary)
        with open(os.path.join(mapper, "manifest.yaml")) as f:
            recorded = yaml.safe_load(f)["quality"]["benefit"]
        self.assertEqual(recorded, document["benefit"])
        inspect = subprocess.run([binary, "inspect", mapper], capture_output=True, text=True)
        self.assertEqual(inspect.returncode, 0, inspect.stderr)
        self.assertIn("heldout", inspect.stdout)
        bad = dict(result, benefit=[dict(result["benefit"][0], lower95=0.7)])
        with self.assertRaisesRegex(qualify.QualifyError,
                                    r"--record: .*kvt record-benefit --mapper=.* failed"):
            qualify.record(bad, mapper, binary)

if __name__ == "__main__":
    unittest.main()
