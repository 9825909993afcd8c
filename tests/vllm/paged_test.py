"""kvt.vllm.paged against vLLM's own CPU attention kernels (no engine): tokens written by
cpu_attn_reshape_and_cache (what the model runner does) are read back exactly by gather_tokens,
and scatter_tokens leaves a cache bit-identical to the kernel's own write, for fp32 and bf16 and
several block sizes and head sizes; the kernel's order is not the allocation's naive view."""

import random
import unittest

import torch
from vllm import _custom_ops as ops

from kvt.vllm.paged import PagedLayout, gather_tokens, layer_order, scatter_tokens

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

    def test_kernel_order_is_not_the_naive_view(self):
        cache, layout, blocks, k, v = self.make(torch.float32, 32, 2, 32)
        kernel_write(cache, layout, blocks, 0, k, v)
        naive_k = cache.view(40, 2, 64, 32)[:, :, :32, :]
        self.assertFalse(torch.equal(naive_k[blocks[0], :, 0, :], k[0]))

    def test_layer_order(self):
        names = [f"model.layers.{i}.self_attn.attn" for i in (10, 2, 0, 1)]
        self.assertEqual(layer_order(names), [f"model.layers.{i}.self_attn.attn"
                                              for i in (0, 1, 2, 10)])


if __name__ == "__main__":
    unittest.main(verbosity=2)
