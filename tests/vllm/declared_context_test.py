"""The bundled family declares the context it was trained on (max_position_embeddings 512,
eval/tinyfamily/README.md "Context"), and a vLLM engine that keeps the declared context refuses
a longer prompt instead of answering from positions the model never learned; within the context
it serves as usual. (The other suites' engines raise the limit through engine_host's
--max_model_len, for timing only.)"""

import os
import tempfile
import unittest

import engines as E
from kvt_testing import tinyfamily as R


class DeclaredContextTest(unittest.TestCase):
    def test_engine_refuses_prompts_past_the_declared_context(self):
        with tempfile.TemporaryDirectory(prefix="kvt-context-") as work:
            engine = E.Engine("L-declared", os.path.join(R.MODELS, "L"), {}, work,
                              max_model_len=0, no_connector=True).start()
            try:
                engine.wait_ready()
                stream = R.heldout_windows(600, 1)[0]
                ok = engine.one(stream[:500], max_tokens=4)
                self.assertEqual(len(ok["token_ids"]), 4)
                with self.assertRaisesRegex(RuntimeError, r"maximum context length is 512 tokens"):
                    engine.one(stream[:513], max_tokens=4)
                # The engine keeps serving after the refusal.
                self.assertEqual(len(engine.one(stream[:100], max_tokens=2)["token_ids"]), 2)
            finally:
                engine.stop()


if __name__ == "__main__":
    unittest.main(verbosity=2)
