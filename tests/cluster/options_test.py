"""kv_connector_extra_config.cluster: parsing (defaults, errors naming the key, `enabled: false`),
and the embedded default: without a cluster section, loading the connector's modules and its
configuration imports neither kvt.cluster nor Mooncake (checked in a fresh interpreter)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import unittest

from kvt.vllm.options import ClusterOptions, ConnectorConfig

BASE = {"kvtd_address": "127.0.0.1:50051", "model_name": "kvt-tiny-L"}


class ClusterOptionsTest(unittest.TestCase):
    def test_absent_or_disabled_is_the_node_local_tier(self):
        self.assertIsNone(ConnectorConfig.from_extra(BASE).cluster)
        self.assertIsNone(ConnectorConfig.from_extra({**BASE, "cluster": None}).cluster)
        off = {**BASE, "cluster": {"master_server_address": "m:50051", "enabled": False}}
        self.assertIsNone(ConnectorConfig.from_extra(off).cluster)

    def test_a_section_with_defaults(self):
        config = ConnectorConfig.from_extra({**BASE, "cluster": {
            "master_server_address": "m:50051", "metadata_server": "http://m:8080/metadata",
            "lookup_timeout_s": 1, "source_dtypes": "bf16, fp16"}})
        c = config.cluster
        self.assertIsInstance(c, ClusterOptions)
        self.assertEqual(c.lookup_timeout_s, 1.0)
        self.assertEqual((c.protocol, c.chunk_blocks, c.put, c.fetch_delay_s), ("tcp", 4, True,
                                                                                  0.0))
        self.assertEqual(c.dtypes("fp32"), ("bf16", "fp16"))
        self.assertEqual(ClusterOptions("m:1").dtypes("fp32"), ("fp32",))
        hash(c)  # one store client per process and configuration is keyed by it

    def test_errors_name_the_key(self):
        cases = [({"metadata_server": "x"}, "cluster.master_server_address is required"),
                 ({"master_server_address": "m:1", "chunk": 4}, "unknown key(s) chunk"),
                 ({"master_server_address": "m:1", "protocol": "udp"}, "cluster.protocol"),
                 ({"master_server_address": "m:1", "chunk_blocks": 0}, "cluster.chunk_blocks"),
                 ({"master_server_address": "m:1", "lookup_timeout_s": "fast"},
                  "cluster.lookup_timeout_s"),
                 ({"master_server_address": "m:1", "source_dtypes": "int8"},
                  "cluster.source_dtypes")]
        for section, message in cases:
            with self.assertRaises(ValueError) as caught:
                ConnectorConfig.from_extra({**BASE, "cluster": section})
            self.assertIn(message, str(caught.exception), section)
        with self.assertRaises(ValueError) as caught:
            ConnectorConfig.from_extra({**BASE, "cluster": "m:1"})
        self.assertIn("cluster: expected an object", str(caught.exception))

    def test_without_a_section_nothing_of_the_cluster_tier_is_imported(self):
        script = (
            "import json, sys\n"
            "import kvt.vllm\n"
            "from kvt.vllm import connector, publisher, scheduler_side, worker_side, stats\n"
            "from kvt.vllm.options import ConnectorConfig\n"
            f"ConnectorConfig.from_extra({BASE!r})\n"
            "print(json.dumps(sorted(m for m in sys.modules if m == 'kvt.cluster' or "
            "m.startswith('mooncake') or m == 'kvt.vllm.cluster_tier')))\n")
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             env=env, timeout=300)
        self.assertEqual(out.returncode, 0, out.stderr[-3000:])
        self.assertEqual(json.loads(out.stdout.strip().splitlines()[-1]), [])


if __name__ == "__main__":
    unittest.main()
