"""kvt.vllm.paged against vLLM's own CPU attention kernels (no engine): tokens written by
cpu_attn_reshape_and_cache (what the model runner does) are read back exactly by gather_tokens,
and scatter_tokens leaves a cache bit-identical to the kernel's own write, for fp32 and bf16 and
several block sizes and head sizes; the kernel's order is not the allocation's naive view. The
block copies (block_views, gather_rows, scatter_rows) agree with the kernel the same way, and
the whole-block copy is measured against the indexed one."""

import time

import random
import unittest

import torch
from vllm import _custom_ops as ops

import numpy as np

from kvt.vllm.paged import (PagedLayout, affine_strides, gather_rows, gather_tokens,
                            layer_order, scatter_rows, scatter_tokens)

CASES = [(torch.float32, 32, 2, 32), (torch.float32, 128, 2, 32), (torch.float32, 64, 4, 64),
         (torch.bfloat16, 32, 2, 32), (torch.bfloat16, 128, 8, 128)]


def kernel_write(cache, layout, block_ids, start, k, v):
    blocks, heads, block_size, _ = cache.shape
    k_cache, v_cache = cache.view(blocks, heads, 2 * block_size, -1).chunk(2, dim=2)
    tokens = torch.arange(start, start + k.shape[0])
    table = torch.tensor(block_ids)
    slots = table[tokens // block_size] * block_size + tokens % block_size
    ops.cpu_attn_reshape_and_cache(k, v, k_cache, v_cache, slots, layout.isa)


class PagedTest(unittest.TestCase):
    def setUp(self):
        torch.manual_seed(0)
        random.seed(0)

    def make(self, dtype, block_size, heads, dim, tokens=150):
        cache = torch.zeros(40, heads, block_size, 2 * dim, dtype=dtype)
        layout = PagedLayout(cache, heads, dim)
        blocks = random.sample(range(1, 40), (tokens + block_size - 1) // block_size)
        k = torch.randn(tokens, heads, dim).to(dtype)
        v = torch.randn(tokens, heads, dim).to(dtype)
        return cache, layout, blocks, k, v

    def test_gather_reads_what_the_kernel_wrote(self):
        for dtype, block_size, heads, dim in CASES:
            with self.subTest(dtype=dtype, block_size=block_size, heads=heads, dim=dim):
                cache, layout, blocks, k, v = self.make(dtype, block_size, heads, dim)
                kernel_write(cache, layout, blocks, 0, k, v)
                gk, gv = gather_tokens(cache, layout, blocks, 0, k.shape[0])
                self.assertTrue(torch.equal(gk, k))
                self.assertTrue(torch.equal(gv, v))
                gk, gv = gather_tokens(cache, layout, blocks, 37, 101)
                self.assertTrue(torch.equal(gk, k[37:101]))
                self.assertTrue(torch.equal(gv, v[37:101]))

    def test_scatter_writes_like_the_kernel(self):
        for dtype, block_size, heads, dim in CASES:
            with self.subTest(dtype=dtype, block_size=block_size, heads=heads, dim=dim):
                ours, layout, blocks, k, v = self.make(dtype, block_size, heads, dim)
                theirs = ours.clone()
                kernel_write(theirs, layout, blocks, 0, k, v)
                # K and V separately, in uneven token ranges, as kvtd's chunks arrive.
                for lo, hi in ((0, 50), (50, 51), (51, 150)):
                    scatter_tokens(ours, layout, blocks, lo, k[lo:hi], None)
                for lo, hi in ((0, 120), (120, 150)):
                    scatter_tokens(ours, layout, blocks, lo, None, v[lo:hi])
                self.assertTrue(torch.equal(ours, theirs))

    def host(self, cache):
        flat = cache.view(-1)
        return (flat.view(torch.int16) if cache.dtype == torch.bfloat16 else flat).numpy()

    def test_block_rows_read_what_the_kernel_wrote(self):
        for dtype, block_size, heads, dim in CASES:
            with self.subTest(dtype=dtype, block_size=block_size, heads=heads, dim=dim):
                cache, layout, blocks, k, v = self.make(dtype, block_size, heads, dim)
                kernel_write(cache, layout, blocks, 0, k, v)
                views = layout.block_views(self.host(cache))
                if None in layout.affine_kv:
                    # AMX bf16 pairs K's dims and V's tokens (VNNI): no strided view of a
                    # block, so the connector copies through `index` (the gather test above).
                    self.assertIsNone(views, layout.isa)
                    continue
                self.assertIsNotNone(views, layout.isa)
                for lo, hi in ((0, 150), (0, 1), (block_size, 150)):
                    gk, gv = gather_rows(views, layout, blocks, lo, hi)
                    for got, want in ((gk, k[lo:hi]), (gv, v[lo:hi])):
                        want = (want.view(torch.int16) if dtype == torch.bfloat16 else want)
                        np.testing.assert_array_equal(got, want.numpy())
                # Straight into caller's arrays (the publish region): the same rows.
                out = tuple(np.zeros((150, heads, dim), dtype=views[0].dtype) for _ in range(2))
                got = gather_rows(views, layout, blocks, 0, 150, out=out)
                self.assertIs(got[0], out[0])
                for array, want in ((out[0], k), (out[1], v)):
                    want = (want.view(torch.int16) if dtype == torch.bfloat16 else want)
                    np.testing.assert_array_equal(array, want.numpy())
                self.assertIsNone(gather_rows(views, layout, blocks, 1, 150))  # not a boundary

    def test_block_scatter_writes_like_the_kernel(self):
        for dtype, block_size, heads, dim in CASES:
            with self.subTest(dtype=dtype, block_size=block_size, heads=heads, dim=dim):
                tokens = 3 * block_size
                ours, layout, blocks, k, v = self.make(dtype, block_size, heads, dim, tokens)
                theirs = ours.clone()
                kernel_write(theirs, layout, blocks, 0, k, v)
                views = layout.block_views(self.host(ours))
                if None in layout.affine_kv:  # as above: the indexed scatter serves
                    self.assertIsNone(views, layout.isa)
                    continue
                bits = (lambda t: t.view(torch.int16).numpy()) if dtype == torch.bfloat16 \
                    else (lambda t: t.numpy())
                self.assertTrue(scatter_rows(views[0], layout, blocks, 0, bits(k)))
                self.assertTrue(scatter_rows(views[1], layout, blocks, 0, bits(v[:block_size])))
                self.assertTrue(scatter_rows(views[1], layout, blocks, block_size,
                                             bits(v[block_size:])))
                self.assertTrue(torch.equal(ours, theirs))
                # Not whole blocks: refused, nothing written.
                before = ours.clone()
                self.assertFalse(scatter_rows(views[0], layout, blocks, 0, bits(k[:5])))
                self.assertFalse(scatter_rows(views[0], layout, blocks, 1, bits(k[1:1 + block_size])))
                self.assertTrue(torch.equal(ours, before))

    def test_block_copy_is_faster_than_the_indexed_copy(self):
        # 2048 tokens of one layer of kvt-tiny-L (2 heads x 32, fp32, block 32): what a load
        # writes per layer and kind. Best of 5 each, side by side.
        cache = torch.zeros(80, 2, 32, 64)
        layout = PagedLayout(cache, 2, 32)
        blocks = list(range(1, 65))
        rows = torch.randn(2048, 2, 32).numpy()
        flat = cache.view(-1).numpy()
        views = layout.block_views(flat)
        index_k, _ = layout.index(blocks, 0, 2048)
        index_k = index_k.numpy()

        def best(fn):
            times = []
            for _ in range(5):
                t = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t)
            return min(times)
        indexed = best(lambda: flat.__setitem__(index_k, rows))
        block = best(lambda: scatter_rows(views[0], layout, blocks, 0, rows))
        print(f"2048 x 2 x 32 fp32 rows into paged blocks: indexed {indexed * 1e3:.3f} ms, "
              f"block copy {block * 1e3:.3f} ms ({indexed / block:.1f}x)")
        self.assertLess(block, indexed)

    def test_kernel_order_is_not_the_naive_view(self):
        cache, layout, blocks, k, v = self.make(torch.float32, 32, 2, 32)
        kernel_write(cache, layout, blocks, 0, k, v)
        naive_k = cache.view(40, 2, 64, 32)[:, :, :32, :]
        self.assertFalse(torch.equal(naive_k[blocks[0], :, 0, :], k[0]))

    def test_affine_detection(self):
        # Every machine checks both answers, whichever ISA its kernels pick: a transposed-keys
        # order ("vec") is affine; AMX bf16's VNNI order (K's dims and V's tokens in pairs) is not.
        t = torch.arange(32).view(32, 1, 1)
        h = torch.arange(2).view(1, 2, 1)
        d = torch.arange(32).view(1, 1, 32)
        self.assertEqual(affine_strides(t + h * 2048 + d * 32), (0, (1, 2048, 32)))
        self.assertIsNone(affine_strides((d // 2) * 64 + t * 2 + d % 2 + h * 2048))
        self.assertIsNone(affine_strides(1024 + (t // 2) * 64 + d * 2 + t % 2 + h * 2048))

    def test_layer_order(self):
        names = [f"model.layers.{i}.self_attn.attn" for i in (10, 2, 0, 1)]
        self.assertEqual(layer_order(names), [f"model.layers.{i}.self_attn.attn"
                                              for i in (0, 1, 2, 10)])


class EngineCacheTest(unittest.TestCase):
    """kvt.vllm.engine_cache: the engine's cache shared in place, and the EngineBlockOrder the
    connector sends kvtd, against what the CPU attention kernel itself wrote."""

    def test_shared_in_place_keeps_bytes_and_describes_the_kernels_order(self):
        import mmap
        import os
        from kvt.vllm.engine_cache import engine_block_order, share_in_place
        for dtype, block_size, heads, dim in CASES:
            with self.subTest(dtype=dtype, block_size=block_size, heads=heads, dim=dim):
                # Like vLLM's allocate_kv_cache: one backing buffer (large enough for glibc to
                # map it on its own), per-layer views.
                per_layer = 40 * heads * block_size * 2 * dim
                backing = torch.zeros(max(2 * per_layer, 40 << 20) // 2, dtype=dtype)
                layers = [backing[i * per_layer:(i + 1) * per_layer].view(
                    40, heads, block_size, 2 * dim) for i in range(2)]
                layout = PagedLayout(layers[0], heads, dim)
                blocks = random.sample(range(1, 40), 5)
                tokens = 5 * block_size - 3
                k = torch.randn(tokens, heads, dim).to(dtype)
                v = torch.randn(tokens, heads, dim).to(dtype)
                kernel_write(layers[0], layout, blocks, 0, -k, -v)
                before = backing.clone()
                address = backing.data_ptr()
                region = share_in_place(layers)
                try:
                    self.assertEqual(backing.data_ptr(), address)
                    self.assertTrue(torch.equal(backing, before))  # same bytes, same place
                    kernel_write(layers[1], layout, blocks, 0, k, v)  # after sharing
                    if None in layout.affine_kv:  # AMX bf16: no order kvtd can write in
                        with self.assertRaisesRegex(ValueError, "not affine"):
                            engine_block_order(region, layers, layout.affine_kv,
                                               layout.block_elems)
                        continue
                    order = engine_block_order(region, layers, layout.affine_kv,
                                               layout.block_elems)
                    self.assertEqual(order["layer_offsets"][1] - order["layer_offsets"][0],
                                     per_layer * layers[0].element_size())
                    fd = os.open("/dev/shm/" + region.key.lstrip("/"), os.O_RDWR)
                    with mmap.mmap(fd, region.byte_size) as other:  # kvtd's view
                        os.close(fd)
                        flat = np.frombuffer(other, dtype=np.uint16 if dtype == torch.bfloat16
                                             else np.float32)
                        for kind, rows in (("k", k), ("v", v)):
                            s = order[kind]
                            t = np.arange(tokens).reshape(-1, 1, 1)
                            h = np.arange(heads).reshape(1, -1, 1)
                            d = np.arange(dim).reshape(1, 1, -1)
                            at = (order["layer_offsets"][1] // layers[0].element_size() +
                                  np.array(blocks)[t // block_size] * order["block_stride"] +
                                  s["offset"] + (t % block_size) * s["slot_stride"] +
                                  h * s["head_stride"] + d * s["dim_stride"])
                            want = rows.view(torch.int16).numpy().view(np.uint16) \
                                if dtype == torch.bfloat16 else rows.numpy()
                            np.testing.assert_array_equal(flat[at], want)
                        del flat
                finally:
                    region.close()
        small = torch.zeros(1000)
        with self.assertRaisesRegex(ValueError, "mapping of its own"):
            share_in_place([small])

    def test_objects_of_dead_engines_are_swept_and_live_ones_kept(self):
        import fcntl
        import os
        import subprocess
        import sys
        from kvt.vllm.engine_cache import share_in_place, sweep_stale_objects
        backing = torch.zeros(20 << 20)
        live = share_in_place([backing])
        dead = f"kvt-engine-0-dead{os.getpid()}"
        held = f"kvt-engine-0-held{os.getpid()}"
        for name in (dead, held):
            with open("/dev/shm/" + name, "wb") as f:
                f.write(b"\0" * 4096)
        # Another process holds `held` the way a live engine holds its object.
        holder = subprocess.Popen([sys.executable, "-c", (
            "import fcntl, os, sys, time\n"
            f"fd = os.open('/dev/shm/{held}', os.O_RDONLY)\n"
            "fcntl.flock(fd, fcntl.LOCK_SH); print('locked', flush=True); time.sleep(60)")],
            stdout=subprocess.PIPE, text=True)
        try:
            self.assertEqual(holder.stdout.readline().strip(), "locked")
            self.assertEqual(sweep_stale_objects(min_age_s=3600), [])  # all too young
            removed = sweep_stale_objects(min_age_s=0)
            self.assertIn(dead, removed)
            self.assertNotIn(held, removed)
            self.assertNotIn(live.key.lstrip("/"), removed)
            self.assertFalse(os.path.exists("/dev/shm/" + dead))
            self.assertTrue(os.path.exists("/dev/shm/" + live.key.lstrip("/")))
            holder.kill()  # its owner gone, the object goes with the next sweep
            holder.wait()
            self.assertIn(held, sweep_stale_objects(min_age_s=0))
        finally:
            holder.kill()
            holder.wait()
            live.close()
            for name in (dead, held):
                if os.path.exists("/dev/shm/" + name):
                    os.unlink("/dev/shm/" + name)


if __name__ == "__main__":
    unittest.main(verbosity=2)
