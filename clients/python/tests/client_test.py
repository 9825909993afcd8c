"""kvt.Client against a real kvtd process serving the bundled demo-tiny mapper: translations
checked against a float64 numpy reference (SPEC 3 tolerances) in both dtypes, layouts and chunk
sizes; ValidateKV; mapper control and the admin role; TLS; shared-memory regions; and every
kind of bad input raising the exception of its gRPC code with a message naming the field.
kvt.Session over a window mapper (demo-tiny widened to window 3) equals one translation."""

from __future__ import annotations

import concurrent.futures
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import unittest
from typing import Iterator, List, Tuple

import grpc
import numpy as np
from safetensors.numpy import load_file, save_file

import kvt
from kvt.proto import mappers_pb2, service_pb2_grpc
from kvt_testing import junit_main
from kvt_testing.kvtd import Kvtd
from kvt_testing.runfiles import runfile, test_tmpdir
from reference import RidgeMapper, max_rel_error

# KVT_TEST_SEED (docs/TESTING.md) replays a run; unset, a fresh seed.
SEED = (int(os.environ["KVT_TEST_SEED"]) if os.environ.get("KVT_TEST_SEED")
        else int.from_bytes(os.urandom(4), "little"))
print(f"client_test: numpy seed {SEED} (replay with KVT_TEST_SEED={SEED})", file=sys.stderr)

ADMIN_TOKEN = "admin-token-abcdefghijk"
CLIENT_TOKEN = "router-token-0123456789"
SOURCE, TARGET = "kvt-demo/tiny-4l", "kvt-demo/tiny-6l"


def make_store(name: str) -> str:
    """A mapper store directory of its own holding a copy of the bundled demo-tiny."""
    store = os.path.join(test_tmpdir(), name)
    shutil.rmtree(store, ignore_errors=True)
    os.makedirs(store)
    source = os.path.dirname(runfile("demo/mappers/demo-tiny/manifest.yaml"))
    destination = os.path.join(store, "demo-tiny")
    os.makedirs(destination)
    for name in ("manifest.yaml", "weights.safetensors", "SHA256SUMS"):
        shutil.copyfile(os.path.join(source, name), os.path.join(destination, name))
    return store


WINDOW, WINDOW_MAPPER = 3, "demo-tiny-w3"


def make_window_store(name: str) -> str:
    """A store holding only demo-tiny widened into a window mapper (manifest `window: 3`): every
    weight gets WINDOW row blocks, offset 0 demo-tiny's own and the earlier tokens' random, so
    each output token also reads the two source tokens before it in the request."""
    store = os.path.join(test_tmpdir(), name)
    shutil.rmtree(store, ignore_errors=True)
    destination = os.path.join(store, WINDOW_MAPPER)
    os.makedirs(destination)
    source = os.path.dirname(runfile("demo/mappers/demo-tiny/manifest.yaml"))
    with open(os.path.join(source, "manifest.yaml"), encoding="utf-8") as f:
        manifest = f.read()
    assert "\nk: 2\n" in manifest
    write(os.path.join(destination, "manifest.yaml"),
          manifest.replace("\nk: 2\n", f"\nk: 2\nwindow: {WINDOW}\n"))
    rng = np.random.default_rng(7)
    tensors = {}
    for tensor_name, tensor in load_file(os.path.join(source, "weights.safetensors")).items():
        if tensor_name.endswith(".weight"):
            earlier = rng.standard_normal((WINDOW - 1, *tensor.shape)) / np.sqrt(tensor.shape[0])
            tensor = np.concatenate([tensor, *earlier.astype(tensor.dtype)], axis=0)
        tensors[tensor_name] = np.ascontiguousarray(tensor)
    save_file(tensors, os.path.join(destination, "weights.safetensors"))
    lines = []
    for file_name in ("manifest.yaml", "weights.safetensors"):
        with open(os.path.join(destination, file_name), "rb") as f:
            lines.append(f"{hashlib.sha256(f.read()).hexdigest()}  {file_name}\n")
    write(os.path.join(destination, "SHA256SUMS"), "".join(lines))
    return store


def write(path: str, text: str) -> str:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
    return path


def random_cache(rng: np.random.Generator, tokens: int, dtype: str = "fp32",
                 layers: int = 4, heads: int = 2, dim: int = 32) -> kvt.KVCache:
    def one() -> np.ndarray:
        array = rng.standard_normal((heads, tokens, dim)).astype(np.float32)
        if dtype == "bf16":  # values the wire carries exactly, so the reference sees the same
            array = kvt.cache.bf16_bits_to_float32(kvt.cache.float32_to_bf16_bits(array))
        return array.astype(np.float16) if dtype == "fp16" else array
    return kvt.KVCache(k=[one() for _ in range(layers)], v=[one() for _ in range(layers)],
                       dtype=dtype)


def check_load_unload(test: unittest.TestCase, client: kvt.Client) -> None:
    """UnloadMapper drops demo-tiny to DISCOVERED, LoadMapper makes it HOST_RESIDENT again."""
    unloaded = client.unload_mapper("demo-tiny")
    test.assertEqual(unloaded.mapper_id, "demo-tiny")
    test.assertEqual(unloaded.state, mappers_pb2.MAPPER_STATE_DISCOVERED)
    test.assertEqual(client.get_mapper("demo-tiny").state, mappers_pb2.MAPPER_STATE_DISCOVERED)
    loaded = client.load_mapper("demo-tiny")
    test.assertEqual(loaded.state, mappers_pb2.MAPPER_STATE_HOST_RESIDENT)
    test.assertIn("host", loaded.devices)
    test.assertGreater(loaded.weight_bytes, 0)
    with test.assertRaises(kvt.NotFoundError) as caught:
        client.load_mapper("no-such-mapper")
    test.assertIn("no-such-mapper", caught.exception.details)


class ClientTest(unittest.TestCase):
    kvtd: Kvtd
    client: kvt.Client
    mapper: RidgeMapper

    @classmethod
    def setUpClass(cls) -> None:
        cls.store = make_store("store")
        # Unix socket paths are limited to 107 characters: $TEST_TMPDIR is too deep.
        cls.socket_dir = tempfile.mkdtemp(prefix="kvt-py-", dir="/tmp")
        cls.socket = os.path.join(cls.socket_dir, "kvtd.sock")
        config = write(os.path.join(test_tmpdir(), "kvtd.yaml"),
                       "shared_memory:\n  allow_client_regions: true\n")
        cls.kvtd = Kvtd(["--listen_address=127.0.0.1:0", f"--mapper_store={cls.store}",
                         "--backend=cpu", "--cpu_threads=1", "--drain_grace_seconds=0",
                         "--max_tokens=4096", f"--config={config}",
                         f"--unix_socket={cls.socket}"]).__enter__()
        cls.client = kvt.Client(cls.kvtd.address, timeout=60)
        cls.mapper = RidgeMapper(os.path.join(cls.store, "demo-tiny"))
        cls.rng = np.random.default_rng(SEED)

    @classmethod
    def tearDownClass(cls) -> None:
        cls.client.close()
        cls.kvtd.__exit__()
        shutil.rmtree(cls.socket_dir, ignore_errors=True)

    def check_against_reference(self, source: kvt.KVCache, result: kvt.TranslateResult,
                                positions: np.ndarray, tolerance: float) -> None:
        hnd = source.to_layout("HND")
        expected_k, expected_v = self.mapper.translate(
            [a.astype(np.float64) for a in hnd.k], [a.astype(np.float64) for a in hnd.v],
            positions)
        target = result.target
        assert target is not None
        self.assertEqual(target.num_layers, 6)
        self.assertEqual(target.num_tokens, source.num_tokens)
        target = target.to_layout("HND")
        for layer in range(6):
            for name, actual, expected in (("K", target.k[layer], expected_k[layer]),
                                           ("V", target.v[layer], expected_v[layer])):
                error = max_rel_error(actual, expected)
                self.assertLessEqual(error, tolerance, f"layer {layer} {name} (seed {SEED})")

    # -- health, mappers -----------------------------------------------------------------------

    def test_health_list_and_get(self) -> None:
        self.assertEqual(self.client.health(), "SERVING")
        mappers = self.client.list_mappers()
        self.assertEqual([m.mapper_id for m in mappers], ["demo-tiny"])
        info = self.client.get_mapper("demo-tiny")
        self.assertEqual((info.source_model, info.target_model), (SOURCE, TARGET))
        self.assertEqual((info.source_shape.num_layers, info.target_shape.num_layers), (4, 6))
        self.assertEqual(info.k, 2)
        self.assertEqual(self.client.find_mapper(SOURCE, TARGET).mapper_id, "demo-tiny")
        with self.assertRaises(kvt.NotFoundError) as caught:
            self.client.get_mapper("no-such-mapper")
        self.assertEqual(caught.exception.code, grpc.StatusCode.NOT_FOUND)
        self.assertIn("no-such-mapper", caught.exception.details)
        with self.assertRaises(kvt.NotFoundError):
            self.client.find_mapper(TARGET, SOURCE)

    def test_server_metadata_names_the_release_and_extensions(self) -> None:
        metadata = self.client.server_metadata()
        self.assertEqual(metadata.name, "kvtd")
        self.assertTrue(metadata.version)
        self.assertEqual(list(metadata.extensions), sorted(metadata.extensions))
        self.assertIn("paged_engine_order", metadata.extensions)
        self.assertTrue(self.client.has_extension("system_shared_memory"))
        self.assertFalse(self.client.has_extension("no_such_extension"))

    def test_a_server_older_than_server_metadata_has_no_extensions(self) -> None:
        # A gRPC server with the generated servicer's defaults answers every RPC UNIMPLEMENTED,
        # as a kvtd from before ServerMetadata answers that one.
        from concurrent import futures
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
        service_pb2_grpc.add_KvTranslatorServicer_to_server(
            service_pb2_grpc.KvTranslatorServicer(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        try:
            with kvt.Client(f"127.0.0.1:{port}", timeout=10) as old:
                with self.assertRaises(kvt.UnimplementedError):
                    old.server_metadata()
                self.assertFalse(old.has_extension("paged_engine_order"))
        finally:
            server.stop(None)

    def test_load_and_unload(self) -> None:
        check_load_unload(self, self.client)
        # A translation pages it back in.
        result = self.client.translate(random_cache(self.rng, 5), mapper_id="demo-tiny")
        self.assertEqual(result.header.mapper_id, "demo-tiny")

    # -- translate -----------------------------------------------------------------------------

    def test_translate_fp32_matches_reference_with_many_chunks(self) -> None:
        tokens = int(self.rng.integers(50, 300))
        offset = int(self.rng.integers(0, 100000))
        source = random_cache(self.rng, tokens)
        # ~7 tokens per request chunk and 5 per response chunk: many chunks each way.
        small = kvt.Client(self.kvtd.address, chunk_bytes=7 * 2 * 32 * 4)
        result = small.translate(source, mapper_id="demo-tiny", position_offset=offset,
                                 response_chunk_tokens=5, request_id="py-fp32")
        small.close()
        self.assertEqual(result.header.request_id, "py-fp32")
        self.assertEqual(result.trailer.num_tokens, tokens)
        self.assertEqual(result.trailer.input_bytes, source.nbytes)
        self.assertEqual(result.target.dtype, "fp32")
        self.check_against_reference(source, result, offset + np.arange(tokens), 1e-5)

    def test_translate_bf16_by_model_pair_to_nhd(self) -> None:
        tokens = int(self.rng.integers(20, 200))
        source = random_cache(self.rng, tokens, dtype="bf16")
        result = self.client.translate(source, source_model=SOURCE, target_model=TARGET,
                                       position_offset=3, output_layout="NHD")
        self.assertEqual(result.target.layout, "NHD")
        self.assertEqual(result.target.dtype, "bf16")
        self.assertEqual(result.target.k[0].shape, (tokens, 2, 32))
        self.check_against_reference(source, result, 3 + np.arange(tokens), 1e-2)

    def test_translate_nhd_fp16_explicit_positions_to_fp32(self) -> None:
        tokens = 64
        source = random_cache(self.rng, tokens, dtype="fp16").to_layout("NHD")
        positions = self.rng.permutation(10 ** 6)[:tokens]
        result = self.client.translate(source, mapper_id="demo-tiny", positions=positions,
                                       output_dtype="fp32", output_layout="HND")
        self.assertEqual((result.target.dtype, result.target.layout), ("fp32", "HND"))
        # fp16 input, fp32 accumulation and output: the fp32 tolerance applies.
        self.check_against_reference(source, result, positions, 1e-5)

    def test_float32_arrays_sent_as_bf16_round_to_nearest_even(self) -> None:
        source = random_cache(self.rng, 16)
        rounded = kvt.KVCache(k=source.k, v=source.v, dtype="bf16")
        result = self.client.translate(rounded, mapper_id="demo-tiny")
        exact = random_cache(self.rng, 16)
        exact.k = [kvt.cache.bf16_bits_to_float32(kvt.cache.float32_to_bf16_bits(a))
                   for a in source.k]
        exact.v = [kvt.cache.bf16_bits_to_float32(kvt.cache.float32_to_bf16_bits(a))
                   for a in source.v]
        self.check_against_reference(exact, result, np.arange(16), 1e-2)
        self.assertEqual(float(kvt.cache.bf16_bits_to_float32(
            kvt.cache.float32_to_bf16_bits(np.array([1.00390625], np.float32)))[0]), 1.0)

    def test_split_translation_equals_whole(self) -> None:
        # The map is token-wise: two halves with position_offset give the whole's result.
        source = random_cache(self.rng, 40)
        whole = self.client.translate(source, mapper_id="demo-tiny", position_offset=7).target
        first = kvt.KVCache(k=[a[:, :25] for a in source.k], v=[a[:, :25] for a in source.v])
        second = kvt.KVCache(k=[a[:, 25:] for a in source.k], v=[a[:, 25:] for a in source.v])
        a = self.client.translate(first, mapper_id="demo-tiny", position_offset=7).target
        b = self.client.translate(second, mapper_id="demo-tiny", position_offset=32).target
        for layer in range(6):
            np.testing.assert_allclose(np.concatenate([a.k[layer], b.k[layer]], 1),
                                       whole.k[layer], rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(np.concatenate([a.v[layer], b.v[layer]], 1),
                                       whole.v[layer], rtol=1e-5, atol=1e-5)

    def test_concurrent_translations_from_threads(self) -> None:
        sources = [random_cache(self.rng, int(self.rng.integers(10, 200))) for _ in range(8)]
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            results = list(pool.map(
                lambda s: self.client.translate(s, mapper_id="demo-tiny", position_offset=2),
                sources))
        for source, result in zip(sources, results):
            self.check_against_reference(source, result, 2 + np.arange(source.num_tokens), 1e-5)

    def test_layers_streamed_while_produced_are_pipelined(self) -> None:
        # demo-tiny's target layer 4 needs source layers 0-2 only (its sigma lists), so kvtd can
        # return it while layer 3 is still being "computed" (the pause below).
        tokens = 1500  # >= kvtd's transport.pipeline_min_tokens (1024)
        source = random_cache(self.rng, tokens, dtype="bf16")
        last_layer_sent: List[float] = []

        def produce() -> Iterator[Tuple[np.ndarray, np.ndarray]]:
            for layer in range(4):
                if layer == 3:
                    time.sleep(1.0)
                    last_layer_sent.append(time.monotonic())
                yield source.k[layer], source.v[layer]

        result = self.client.translate_layers(produce(), num_layers=4, num_tokens=tokens,
                                              dtype="bf16", mapper_id="demo-tiny",
                                              position_offset=4)
        self.assertTrue(result.trailer.pipelined)
        self.assertLess(result.first_chunk_at, last_layer_sent[0])
        self.check_against_reference(source, result, 4 + np.arange(tokens), 1e-2)

    def test_layer_producer_errors(self) -> None:
        good = random_cache(self.rng, 6)
        pairs = list(zip(good.k, good.v))
        stream = lambda layers, n=4: self.client.translate_layers(  # noqa: E731
            iter(layers), num_layers=n, num_tokens=6, mapper_id="demo-tiny")
        self.assert_code(kvt.InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT,
                         "3 layers produced", lambda: stream(pairs[:3]))
        self.assert_code(kvt.InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT,
                         "more than num_layers", lambda: stream(pairs + pairs[:1]))
        bad = pairs[:2] + [(np.zeros((2, 7, 32), np.float32),) * 2] + pairs[3:]
        self.assert_code(kvt.InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT,
                         "layer 2", lambda: stream(bad))

        def failing() -> Iterator[Tuple[np.ndarray, np.ndarray]]:
            yield pairs[0]
            raise RuntimeError("prefill crashed")

        with self.assertRaisesRegex(RuntimeError, "prefill crashed"):
            stream(failing())

    def test_split_into_requests_under_max_tokens(self) -> None:
        # 4100 tokens exceed this kvtd's limits.max_tokens (4096): max_request_tokens splits.
        source = random_cache(self.rng, 4100)
        with kvt.Client(self.kvtd.address, max_request_tokens=4096) as client:
            result = client.translate(source, mapper_id="demo-tiny", position_offset=9,
                                      request_id="long")
        self.assertEqual([p.header.num_tokens for p in result.parts], [4096, 4])
        self.assertEqual([p.trailer.request_id for p in result.parts], ["long/0", "long/1"])
        self.assertEqual((result.header.num_tokens, result.trailer.num_tokens), (4100, 4100))
        self.assertEqual(result.trailer.input_bytes, source.nbytes)
        self.check_against_reference(source, result, 9 + np.arange(4100), 1e-5)

    def test_unix_socket(self) -> None:
        with kvt.Client("unix:" + self.socket, timeout=30) as client:
            self.assertEqual(client.health(), "SERVING")
            source = random_cache(self.rng, 8)
            result = client.translate(source, mapper_id="demo-tiny")
            self.check_against_reference(source, result, np.arange(8), 1e-5)

    def test_session_turns_equal_one_translation(self) -> None:
        source = random_cache(self.rng, 90)
        session = kvt.Session(self.client, source_model=SOURCE, target_model=TARGET,
                              start_position=5, session_id="conv-1")
        for start, end in ((0, 40), (40, 41), (41, 90)):
            piece = kvt.KVCache(k=[a[:, start:end] for a in source.k],
                                v=[a[:, start:end] for a in source.v])
            result = session.extend(piece)
            self.assertEqual(result.target.num_tokens, end - start)
        self.assertEqual((session.tokens, session.turns), (90, 3))
        # Token-wise: nothing kept, nothing re-sent.
        self.assertEqual((session.window, session.kept_tokens), (1, 0))
        whole = kvt.TranslateResult(header=None, trailer=None, target=session.target)
        self.check_against_reference(source, whole, 5 + np.arange(90), 1e-5)
        with self.assertRaises(kvt.InvalidArgumentError) as caught:
            session.extend(random_cache(self.rng, 4, dtype="fp16"))
        self.assertIn("turn 4", str(caught.exception))

    def test_paged_regions_equal_inline(self) -> None:
        tokens, block_size, num_blocks = 37, 8, 9  # 5 blocks used of 9
        source = random_cache(self.rng, tokens, dtype="bf16")
        inline = self.client.translate(source, mapper_id="demo-tiny", position_offset=11).target
        in_paged = kvt.PagedBlocks(num_blocks=num_blocks, block_size=block_size,
                                   block_table=[int(b) for b in self.rng.permutation(9)[:5]])
        used = [int(b) for b in self.rng.permutation(9)[:5]]
        out_paged = kvt.PagedBlocks(num_blocks=num_blocks, block_size=block_size,
                                    block_table=used)
        in_bytes = kvt.cache.paged_nbytes(4, num_blocks, block_size, 2, 32, "bf16")
        out_bytes = kvt.cache.paged_nbytes(6, num_blocks, block_size, 2, 32, "bf16")
        with self.client.create_region(in_bytes + out_bytes) as region:
            region.write(in_bytes, b"\xff" * out_bytes)
            # Input blocks ordered HND (FlashInfer), output blocks NHD (vLLM).
            region.write_paged(source, 0, in_paged, block_layout="HND")
            result = self.client.translate_regions(
                input_region=region.name, input_byte_size=in_bytes, input_paged=in_paged,
                output_region=region.name, output_offset=in_bytes, output_byte_size=out_bytes,
                output_paged=out_paged, num_tokens=tokens, dtype="bf16", layout="HND",
                output_layout="NHD", mapper_id="demo-tiny", position_offset=11)
            self.assertIsNone(result.target)
            target = region.read_paged(in_bytes, 6, 2, 32, tokens, "bf16", out_paged,
                                       block_layout="NHD", layout="HND")
            raw = np.frombuffer(region.read(in_bytes, out_bytes), dtype=np.uint8).reshape(
                6, 2, num_blocks, -1)
        for layer in range(6):
            np.testing.assert_array_equal(target.k[layer], inline.k[layer])
            np.testing.assert_array_equal(target.v[layer], inline.v[layer])
        # Blocks outside the table, and the unused tail of the last block, stay untouched.
        unused = [b for b in range(num_blocks) if b not in used]
        self.assertTrue((raw[:, :, unused] == 0xFF).all())
        tail = raw[:, :, used[-1]].reshape(6, 2, block_size, -1)[:, :, tokens % block_size:]
        self.assertTrue((tail == 0xFF).all())

    # -- validate ------------------------------------------------------------------------------

    def test_validate(self) -> None:
        tokens = 48
        source = random_cache(self.rng, tokens)
        truth = self.client.translate(source, mapper_id="demo-tiny").target
        queries = random_cache(self.rng, tokens, layers=6, heads=4)
        report = self.client.validate(source, truth, queries, mapper_id="demo-tiny", turn=2)
        self.assertEqual(report.mapper_id, "demo-tiny")
        self.assertEqual(len(report.layers), 6)
        for layer in report.layers:
            self.assertGreater(layer.r2_k, 0.999999)
            self.assertGreater(layer.cosine_v, 0.999999)
            self.assertTrue(layer.HasField("attention_cosine"))
            self.assertGreater(layer.attention_cosine, 0.999999)
        # Against an unrelated "true" cache the same mapper scores badly.
        unrelated = random_cache(self.rng, tokens, layers=6)
        bad = self.client.validate(source, unrelated, mapper_id="demo-tiny")
        self.assertLess(bad.overall.r2_v, 0.1)
        self.assertFalse(bad.layers[0].HasField("attention_cosine"))
        with self.assertRaises(kvt.InvalidArgumentError):
            self.client.validate(source, random_cache(self.rng, tokens + 1, layers=6),
                                 mapper_id="demo-tiny")

    # -- bad input -----------------------------------------------------------------------------

    def assert_code(self, error_class: type, code: grpc.StatusCode, fragment: str,
                    call: object) -> None:
        with self.assertRaises(error_class) as caught:
            call()  # type: ignore[operator]
        self.assertEqual(caught.exception.code, code)
        self.assertIn(fragment, str(caught.exception))

    def test_bad_input_gets_the_grpc_code_and_names_the_field(self) -> None:
        c = self.client
        self.assert_code(kvt.NotFoundError, grpc.StatusCode.NOT_FOUND, "nope",
                         lambda: c.translate(random_cache(self.rng, 4), mapper_id="nope"))
        # Wrong shapes for the mapper: 3 source layers, head_dim 16.
        self.assert_code(kvt.InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT, "layer",
                         lambda: c.translate(random_cache(self.rng, 4, layers=3),
                                             mapper_id="demo-tiny"))
        self.assert_code(kvt.InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT, "head",
                         lambda: c.translate(random_cache(self.rng, 4, dim=16),
                                             mapper_id="demo-tiny"))
        # More tokens than the server's limits.max_tokens (4096 here).
        self.assert_code(kvt.ResourceExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED,
                         "num_tokens", lambda: c.translate(random_cache(self.rng, 4097),
                                                           mapper_id="demo-tiny"))
        # The pair and the mapper disagree.
        self.assert_code(kvt.InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT, "",
                         lambda: c.translate(random_cache(self.rng, 4), mapper_id="demo-tiny",
                                             source_model=TARGET, target_model=SOURCE))
        # Caught in the client before anything is sent.
        self.assert_code(kvt.InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT,
                         "mapper_id", lambda: c.translate(random_cache(self.rng, 4)))
        self.assert_code(kvt.InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT,
                         "layer 1 V", lambda: kvt.KVCache(
                             k=[np.zeros((2, 4, 32))] * 2,
                             v=[np.zeros((2, 4, 32)), np.zeros((2, 5, 32))]))
        self.assert_code(kvt.InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT, "dtype",
                         lambda: kvt.KVCache(k=[np.zeros((2, 4, 32))],
                                             v=[np.zeros((2, 4, 32))], dtype="int8"))
        self.assert_code(kvt.InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT,
                         "positions", lambda: c.translate(random_cache(self.rng, 4),
                                                          mapper_id="demo-tiny",
                                                          positions=[1, 2]))
        self.assert_code(kvt.InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT,
                         "output_dtype", lambda: c.translate(random_cache(self.rng, 4),
                                                             mapper_id="demo-tiny",
                                                             output_dtype="fp8"))
        # A deadline that has passed before the server can answer.
        self.assert_code(kvt.DeadlineExceededError, grpc.StatusCode.DEADLINE_EXCEEDED, "",
                         lambda: c.translate(random_cache(self.rng, 2000),
                                             mapper_id="demo-tiny", timeout=1e-4))
        # No server there.
        with kvt.Client("127.0.0.1:1", timeout=5) as nowhere:
            self.assert_code(kvt.UnavailableError, grpc.StatusCode.UNAVAILABLE, "",
                             nowhere.list_mappers)

    # -- shared memory -------------------------------------------------------------------------

    def test_shared_memory_round_trip_equals_inline(self) -> None:
        for dtype, layout in (("bf16", "HND"), ("fp32", "NHD")):
            source = random_cache(self.rng, 77, dtype=dtype).to_layout(layout)
            inline = self.client.translate(source, mapper_id="demo-tiny", position_offset=33)
            shm = self.client.translate_via_shm(source, mapper_id="demo-tiny",
                                                position_offset=33)
            self.assertEqual(shm.trailer.output_bytes, inline.target.nbytes)
            for layer in range(6):
                np.testing.assert_array_equal(shm.target.k[layer], inline.target.k[layer])
                np.testing.assert_array_equal(shm.target.v[layer], inline.target.v[layer])
        self.assertEqual(self.client.system_memory_status(), [])

    def test_region_lifecycle_and_cleanup(self) -> None:
        source = random_cache(self.rng, 10)
        with self.client.create_region(source.nbytes + 4096) as region:
            key = region.key
            self.assertTrue(os.path.exists("/dev/shm" + key))
            status = self.client.system_memory_status(region.name)
            self.assertEqual([(r.name, r.key, r.byte_size) for r in status],
                             [(region.name, key, source.nbytes + 4096)])
            region.write_cache(source, offset=100)
            back = region.read_cache(100, 4, 2, 32, 10, "fp32")
            np.testing.assert_array_equal(back.k[3], source.k[3])
            with self.assertRaises(kvt.InvalidArgumentError):
                region.write_cache(source, offset=4097)
            # A RegionRef beyond the region: the server names the field.
            self.assert_code(kvt.InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT,
                             "region", lambda: self.client.translate_regions(
                                 input_region=region.name, output_region=region.name,
                                 num_tokens=10, dtype="fp32", input_byte_size=source.nbytes,
                                 output_byte_size=10 ** 9, mapper_id="demo-tiny"))
            # An unknown region name.
            with self.assertRaises(kvt.KvtError):
                self.client.translate_regions(
                    input_region="nope", output_region=region.name, num_tokens=10,
                    dtype="fp32", input_byte_size=source.nbytes, output_byte_size=1,
                    mapper_id="demo-tiny")
        self.assertFalse(os.path.exists("/dev/shm" + key))
        self.assertEqual(self.client.system_memory_status(), [])
        # A name the server already has: registration fails and the object is unlinked.
        with self.client.create_region(64, name="taken") as taken:
            before = set(os.listdir("/dev/shm"))
            with self.assertRaises(kvt.AlreadyExistsError):
                self.client.create_region(64, name="taken")
            self.assertEqual(set(os.listdir("/dev/shm")), before)
            self.assertTrue(os.path.exists("/dev/shm" + taken.key))

    def test_cuda_memory_calls_reach_the_server(self) -> None:
        # No usable CUDA device here: kvtd says why with the code of its registry.
        with self.assertRaises(kvt.KvtError) as caught:
            self.client.register_cuda_memory("gpu-region", b"\0" * 64, 0, 1 << 20)
        self.assertIn(caught.exception.code, (grpc.StatusCode.FAILED_PRECONDITION,
                                              grpc.StatusCode.UNAVAILABLE))
        self.assertEqual(self.client.cuda_memory_status(), [])
        self.assert_code(kvt.InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT, "64",
                         lambda: self.client.register_cuda_memory("bad", b"short", 0, 1 << 20))
        with self.assertRaises(kvt.NotFoundError):
            self.client.unregister_cuda_memory("gpu-region")

    def test_shared_memory_refused_when_disabled(self) -> None:
        with Kvtd(["--listen_address=127.0.0.1:0", f"--mapper_store={self.store}",
                   "--backend=cpu", "--drain_grace_seconds=0"], "noshm") as plain:
            with kvt.Client(plain.address, timeout=30) as client:
                before = set(os.listdir("/dev/shm"))
                with self.assertRaises(kvt.FailedPreconditionError) as caught:
                    client.translate_via_shm(random_cache(self.rng, 8), mapper_id="demo-tiny")
                self.assertIn("allow_client_regions", str(caught.exception))
                self.assertEqual(set(os.listdir("/dev/shm")), before)


_PKI: List[str] = []


def make_pki() -> str:
    """A CA, a server certificate for 127.0.0.1/localhost and a client certificate (openssl),
    made once per test process."""
    if _PKI:
        return _PKI[0]
    directory = os.path.join(test_tmpdir(), "pki")
    shutil.rmtree(directory, ignore_errors=True)
    os.makedirs(directory)
    script = (
        "set -e\n"
        "ossl() { openssl \"$@\" 2>/dev/null; }\n"
        "ossl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=ca -keyout ca.key -out ca.pem\n"
        "ossl req -newkey rsa:2048 -nodes -subj /CN=server -keyout server.key -out server.csr\n"
        "printf 'subjectAltName=DNS:localhost,IP:127.0.0.1\\n' > server.ext\n"
        "ossl x509 -req -in server.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 "
        "-extfile server.ext -out server.pem\n"
        "ossl req -newkey rsa:2048 -nodes -subj /CN=router -keyout client.key -out client.csr\n"
        "ossl x509 -req -in client.csr -CA ca.pem -CAkey ca.key -CAcreateserial -days 2 "
        "-out client.pem\n")
    subprocess.run(["bash", "-c", script], cwd=directory, check=True)
    _PKI.append(directory)
    return directory


class WindowSessionTest(unittest.TestCase):
    """kvt.Session through a window mapper: each later turn re-sends the window's w - 1 tokens
    before it and drops their outputs, so the turns equal one translation of the whole, where
    the same pieces sent naively (no overlap) do not."""

    kvtd: Kvtd
    client: kvt.Client

    @classmethod
    def setUpClass(cls) -> None:
        cls.store = make_window_store("window_store")
        cls.kvtd = Kvtd(["--listen_address=127.0.0.1:0", f"--mapper_store={cls.store}",
                         "--backend=cpu", "--cpu_threads=1", "--drain_grace_seconds=0"],
                        name="kvtd-window").__enter__()
        cls.client = kvt.Client(cls.kvtd.address, timeout=60)
        cls.rng = np.random.default_rng(SEED + 1)

    @classmethod
    def tearDownClass(cls) -> None:
        cls.client.close()
        cls.kvtd.__exit__()

    def assert_close(self, actual: kvt.KVCache, expected: kvt.KVCache, tolerance: float
                     ) -> float:
        """The worst relative error of `actual` against `expected` over every layer's K and V,
        asserted <= tolerance (pass inf to only measure it)."""
        actual, expected = actual.to_layout("HND"), expected.to_layout("HND")
        self.assertEqual(actual.num_tokens, expected.num_tokens)
        worst = 0.0
        for layer in range(expected.num_layers):
            for got, want in ((actual.k[layer], expected.k[layer]),
                              (actual.v[layer], expected.v[layer])):
                worst = max(worst, max_rel_error(got, want))
        self.assertLessEqual(worst, tolerance, f"seed {SEED}")
        return worst

    def session(self, client: kvt.Client, by_pair: bool) -> kvt.Session:
        if by_pair:
            return kvt.Session(client, source_model=SOURCE, target_model=TARGET,
                               start_position=7, output_layout="HND")
        return kvt.Session(client, mapper_id=WINDOW_MAPPER, start_position=7,
                           output_layout="HND")

    def test_mapper_reports_the_window(self) -> None:
        self.assertEqual(self.client.get_mapper(WINDOW_MAPPER).window, WINDOW)

    def test_turns_equal_one_translation(self) -> None:
        source = random_cache(self.rng, 60)
        whole = self.client.translate(source, mapper_id=WINDOW_MAPPER, position_offset=7,
                                      output_layout="HND").target
        # Turns shorter than the window's reach (1 token), from the very first on.
        turns = ((0, 1), (1, 2), (2, 20), (20, 21), (21, 23), (23, 60))
        for by_pair, layout in ((False, "HND"), (True, "NHD")):
            with self.subTest(by_pair=by_pair, layout=layout):
                cache = source.to_layout(layout)
                session = self.session(self.client, by_pair)
                naive = []
                for start, end in turns:
                    piece = cache.slice_tokens(start, end)
                    result = session.extend(piece)
                    self.assertEqual(result.header.mapper_id, WINDOW_MAPPER)
                    self.assertEqual(result.target.num_tokens, end - start)
                    self.assertEqual(result.header.num_tokens, end - start)
                    # The request carried min(w - 1, tokens before the turn) more.
                    self.assertEqual(result.trailer.num_tokens,
                                     end - start + min(WINDOW - 1, start))
                    self.assertEqual((session.window, session.kept_tokens),
                                     (WINDOW, min(WINDOW - 1, end)))
                    naive.append(self.client.translate(
                        piece, mapper_id=WINDOW_MAPPER, position_offset=7 + start,
                        output_layout="HND").target)
                self.assertEqual((session.tokens, session.turns), (60, len(turns)))
                self.assert_close(session.target, whole, 1e-5)
                # Each naive piece's first tokens read zeros for the tokens before it.
                self.assertGreater(
                    self.assert_close(kvt.KVCache.concat(naive), whole, float("inf")), 1e-3)

    def test_turns_split_by_max_request_tokens_equal_one_translation(self) -> None:
        source = random_cache(self.rng, 50, dtype="bf16")
        whole = self.client.translate(source, mapper_id=WINDOW_MAPPER, position_offset=7,
                                      output_layout="HND", output_dtype="fp32").target
        # At most 8 tokens a request: 6 new ones after the 2 re-sent.
        with kvt.Client(self.kvtd.address, timeout=60, max_request_tokens=8) as small:
            # Client.translate splits with the window's overlap too, for any caller.
            for by_pair in (False, True):
                split = small.translate(source, mapper_id="" if by_pair else WINDOW_MAPPER,
                                        source_model=SOURCE if by_pair else "",
                                        target_model=TARGET if by_pair else "",
                                        position_offset=7, output_layout="HND",
                                        output_dtype="fp32")
                self.assertEqual(split.header.num_tokens, 50)
                self.assertTrue(all(p.trailer.num_tokens <= 8 for p in split.parts))
                self.assert_close(split.target, whole, 1e-5)
            for by_pair in (False, True):
                with self.subTest(by_pair=by_pair):
                    session = kvt.Session(small, mapper_id="" if by_pair else WINDOW_MAPPER,
                                          source_model=SOURCE if by_pair else "",
                                          target_model=TARGET if by_pair else "",
                                          start_position=7, output_dtype="fp32")
                    for start, end in ((0, 30), (30, 31), (31, 50)):
                        result = session.extend(source.slice_tokens(start, end),
                                                request_id=f"split-{start}")
                        self.assertEqual(result.target.num_tokens, end - start)
                        self.assertTrue(all(p.trailer.num_tokens <= 8 for p in result.parts))
                    self.assertEqual(session.tokens, 50)
                    self.assert_close(session.target, whole, 1e-5)
        with kvt.Client(self.kvtd.address, timeout=60, max_request_tokens=2) as tiny:
            session = kvt.Session(tiny, mapper_id=WINDOW_MAPPER)
            with self.assertRaises(kvt.InvalidArgumentError) as caught:
                session.extend(source.slice_tokens(0, 5))
            self.assertIn("max_request_tokens=2", caught.exception.details)
            self.assertEqual((session.tokens, session.turns), (0, 0))

    def test_unknown_mapper_is_refused_before_translating(self) -> None:
        session = kvt.Session(self.client, mapper_id="no-such-mapper")
        with self.assertRaises(kvt.NotFoundError) as caught:
            session.extend(random_cache(self.rng, 3))
        self.assertIn("no-such-mapper", caught.exception.details)
        self.assertEqual((session.tokens, session.turns), (0, 0))


class WindowReloadTest(unittest.TestCase):
    """A mapper hot-reloaded under the same id with another window: every response names the
    window that served it, so a session refuses a later turn the overlap it carried is too
    short for, serves on after a narrower one, and a split call whose lookup predates the
    reload is made again with the wider window."""

    def setUp(self) -> None:
        self.store = make_store("reload_store")  # demo-tiny, token-wise
        self.windowed = os.path.join(make_window_store("reload_window_source"), WINDOW_MAPPER)
        self.token_wise = os.path.dirname(runfile("demo/mappers/demo-tiny/manifest.yaml"))
        config = write(os.path.join(test_tmpdir(), "reload.yaml"),
                       f"mapper_store:\n  path: {self.store}\n  reload_interval_seconds: 0.05\n")
        self.kvtd = Kvtd([f"--config={config}", "--listen_address=127.0.0.1:0",
                          "--backend=cpu", "--cpu_threads=1", "--drain_grace_seconds=0"],
                         name="kvtd-reload").__enter__()
        self.client = kvt.Client(self.kvtd.address, timeout=60)
        self.rng = np.random.default_rng(SEED + 2)

    def tearDown(self) -> None:
        self.client.close()
        self.kvtd.__exit__()

    def reload(self, source_dir: str, generation: int) -> None:
        """Replaces demo-tiny with source_dir's files (renamed into place, as kvt fit does) and
        waits for the poller to load that version."""
        staged = os.path.join(self.store, f".demo-tiny.tmp-{generation}")
        os.makedirs(staged)
        for name in ("manifest.yaml", "weights.safetensors", "SHA256SUMS"):
            shutil.copyfile(os.path.join(source_dir, name), os.path.join(staged, name))
        old = os.path.join(self.store, f".demo-tiny.old-{generation}")
        os.rename(os.path.join(self.store, "demo-tiny"), old)
        os.rename(staged, os.path.join(self.store, "demo-tiny"))
        deadline = time.monotonic() + 30
        while self.client.get_mapper("demo-tiny").generation < generation:
            self.assertLess(time.monotonic(), deadline, "the reload was not picked up")
            time.sleep(0.05)

    def test_a_wider_window_is_refused_and_a_narrower_one_serves(self) -> None:
        source = random_cache(self.rng, 30)
        widened = kvt.Session(self.client, mapper_id="demo-tiny")
        self.assertEqual(widened.extend(source.slice_tokens(0, 20)).header.window, 1)
        self.reload(self.windowed, 2)
        with self.assertRaises(kvt.FailedPreconditionError) as caught:
            widened.extend(source.slice_tokens(20, 30))
        self.assertIn("served by mapper 'demo-tiny' with window 3, earlier turns by "
                      "'demo-tiny' with window 1", caught.exception.details)
        self.assertEqual((widened.tokens, widened.turns), (20, 1))

        narrowed = kvt.Session(self.client, mapper_id="demo-tiny")
        narrowed.extend(source.slice_tokens(0, 20))
        self.assertEqual((narrowed.window, narrowed.kept_tokens), (WINDOW, WINDOW - 1))
        self.reload(self.token_wise, 3)
        turn = narrowed.extend(source.slice_tokens(20, 30))
        self.assertEqual((turn.header.window, turn.target.num_tokens), (1, 10))
        self.assertEqual((narrowed.window, narrowed.kept_tokens), (1, 0))
        alone = self.client.translate(source.slice_tokens(20, 30), mapper_id="demo-tiny",
                                      position_offset=20).target
        self.assertLessEqual(max(max_rel_error(a, b) for a, b in zip(
            turn.target.k + turn.target.v, alone.k + alone.v)), 1e-6)

    def test_a_split_looked_up_before_a_reload_is_made_again(self) -> None:
        source = random_cache(self.rng, 40)
        stale = self.client.get_mapper("demo-tiny")  # window 1: the lookup before the reload
        self.reload(self.windowed, 2)
        whole = self.client.translate(source, mapper_id="demo-tiny").target
        with kvt.Client(self.kvtd.address, timeout=60, max_request_tokens=8) as small:
            small.find_mapper = lambda *args, **kwargs: stale  # type: ignore[method-assign]
            split = small.translate(source, mapper_id="demo-tiny")
        self.assertEqual(split.header.window, WINDOW)
        # Made again with the wider window: 6 new tokens per request after the first.
        self.assertEqual([p.trailer.num_tokens for p in split.parts],
                         [6, 8, 8, 8, 8, 8, 6])
        self.assertLessEqual(max(max_rel_error(a, b) for a, b in zip(
            split.target.k + split.target.v, whole.k + whole.v)), 1e-5)


class SecurityTest(unittest.TestCase):
    """Bearer tokens with roles and TLS against a kvtd started with both."""

    @classmethod
    def setUpClass(cls) -> None:
        cls.dir = make_pki()
        tokens = write(os.path.join(cls.dir, "tokens"),
                       f"{CLIENT_TOKEN} client\n{ADMIN_TOKEN} admin\n")
        cls.kvtd = Kvtd(["--listen_address=127.0.0.1:0",
                         f"--mapper_store={make_store('secure-store')}", "--backend=cpu",
                         "--drain_grace_seconds=0",
                         f"--tls_cert_file={cls.dir}/server.pem",
                         f"--tls_key_file={cls.dir}/server.key",
                         f"--auth_token_file={tokens}"], "secure").__enter__()
        with open(os.path.join(cls.dir, "ca.pem"), "rb") as f:
            cls.ca = f.read()

    @classmethod
    def tearDownClass(cls) -> None:
        cls.kvtd.__exit__()

    def connect(self, token: str = "", tls: bool = True) -> kvt.Client:
        return kvt.Client(self.kvtd.address, timeout=30, bearer_token=token or None,
                          tls_root_ca=self.ca if tls else None)

    def test_roles(self) -> None:
        with self.connect(CLIENT_TOKEN) as router, self.connect(ADMIN_TOKEN) as admin:
            self.assertEqual([m.mapper_id for m in router.list_mappers()], ["demo-tiny"])
            with self.assertRaises(kvt.PermissionDeniedError) as caught:
                router.load_mapper("demo-tiny")
            self.assertEqual(caught.exception.code, grpc.StatusCode.PERMISSION_DENIED)
            with self.assertRaises(kvt.PermissionDeniedError):
                router.unload_mapper("demo-tiny")
            check_load_unload(self, admin)
            rng = np.random.default_rng(SEED)
            result = router.translate(random_cache(rng, 12), mapper_id="demo-tiny")
            self.assertEqual(result.target.num_layers, 6)

    def test_missing_or_wrong_token_and_plaintext(self) -> None:
        with self.connect() as anonymous:
            self.assertEqual(anonymous.health(), "SERVING")  # probes stay open
            with self.assertRaises(kvt.UnauthenticatedError):
                anonymous.list_mappers()
        with self.connect("not-a-valid-token-at-all") as wrong:
            with self.assertRaises(kvt.UnauthenticatedError):
                wrong.list_mappers()
        with self.connect(CLIENT_TOKEN, tls=False) as plaintext:
            with self.assertRaises(kvt.UnavailableError):
                plaintext.list_mappers()


class MutualTlsTest(unittest.TestCase):
    def test_client_certificate_required(self) -> None:
        pki = make_pki()
        with Kvtd(["--listen_address=127.0.0.1:0", f"--mapper_store={make_store('mtls-store')}",
                   "--backend=cpu", "--drain_grace_seconds=0",
                   f"--tls_cert_file={pki}/server.pem", f"--tls_key_file={pki}/server.key",
                   f"--tls_client_ca_file={pki}/ca.pem"], "mtls") as server:
            read = lambda name: open(os.path.join(pki, name), "rb").read()  # noqa: E731
            with kvt.Client(server.address, timeout=30, tls_root_ca=read("ca.pem"),
                            tls_client_cert=read("client.pem"),
                            tls_client_key=read("client.key")) as client:
                self.assertEqual([m.mapper_id for m in client.list_mappers()], ["demo-tiny"])
            with kvt.Client(server.address, timeout=30, tls_root_ca=read("ca.pem")) as nocert:
                with self.assertRaises(kvt.UnavailableError):
                    nocert.list_mappers()
        with self.assertRaises(kvt.InvalidArgumentError):
            kvt.Client("127.0.0.1:1", tls_client_cert=read("client.pem"))


if __name__ == "__main__":
    junit_main.main()
