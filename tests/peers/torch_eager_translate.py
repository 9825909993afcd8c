#!/usr/bin/env python3
"""The kvt mapping written naively in eager PyTorch, as a user's first script would: the peer
that kvt's CPU backend is compared with in docs/BENCHMARKS.md ("CPU translate on oneDNN bf16").

Same shapes and FLOPs as kernels/cpu_backend_benchmark.cc: a scaled-down Qwen3 pair (8 KV heads
x 128 dims on both sides, RoPE theta 1e6 neox over the full head), bf16 caches in HND layout
([heads, tokens, head_dim] per layer), sigma = every one of the k source layers, position offset
100. Per target layer and K|V: gather the sigma layers, strip the source RoPE (keys), one matmul,
bias, target RoPE (keys), convert to bf16 and write into the HND target. FLOPs 2 T (k n d) (n d)
2 L_t, as the C++ one. Two variants of the weights, both of which a user would write:
- bf16: bf16 weights, x rounded to bf16, one bf16 matmul (fp32 accumulation inside oneDNN);
- fp32: fp32 weights and x, one fp32 matmul (MKL / oneDNN sgemm). On CPUs whose bf16 units are
  slow or absent this is the faster one; kvt is compared with the faster of the two.

    /path/to/venv/bin/python tests/peers/torch_eager_translate.py            # default shapes
    python tests/peers/torch_eager_translate.py --shapes 4096/2/2 --repetitions 5

Prints one row per shape and variant: tokens/s and GFLOP/s of the eager translation, GFLOP/s of
bare matmuls of the same FLOPs and dtype in the same process (torch.matmul), and the least
process CPU time of each (comparable with cpu_backend_benchmark's CPU-time table); then per shape
which variant was faster.
"""
import argparse
import os
import time

import torch

HEADS = 8
HEAD_DIM = 128
WIDTH = HEADS * HEAD_DIM
THETA = 1e6
OFFSET = 100


def rope_tables(positions):
    inv_freq = 1.0 / (THETA ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float64) / HEAD_DIM))
    angles = positions.to(torch.float64)[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)  # neox: dimension m pairs with m + d/2
    return angles.cos().to(torch.float32), angles.sin().to(torch.float32)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def translate(source_k, source_v, weights, sigma, tokens, target_k, target_v):
    """One whole-cache translation; target_* are preallocated [L_t] lists of HND bf16 tensors.
    x takes the weights' dtype (bf16 or fp32)."""
    positions = torch.arange(OFFSET, OFFSET + tokens)
    cos, sin = rope_tables(positions)  # [T, d]
    for l, (w_k, b_k, w_v, b_v) in enumerate(weights):
        for is_key, caches, w, b, out in ((True, source_k, w_k, b_k, target_k[l]),
                                          (False, source_v, w_v, b_v, target_v[l])):
            blocks = []
            for j in sigma[l]:
                x = caches[j].transpose(0, 1)  # HND [n, T, d] -> [T, n, d]
                if is_key:
                    x = x.float()
                    x = x * cos[:, None, :] - rotate_half(x) * sin[:, None, :]  # strip
                blocks.append(x.reshape(tokens, WIDTH).to(w.dtype))
            x = torch.cat(blocks, dim=1)  # [T, k n d]
            y = (x @ w).float() + b  # [T, n d]
            y = y.view(tokens, HEADS, HEAD_DIM)
            if is_key:
                y = y * cos[:, None, :] + rotate_half(y) * sin[:, None, :]  # apply
            out.copy_(y.to(torch.bfloat16).transpose(0, 1))  # -> HND


def best_seconds(fn, repetitions):
    """(least wall seconds, least process CPU seconds) of one call over the repetitions."""
    fn()  # warm-up (oneDNN primitive creation, allocator)
    best, best_cpu = float("inf"), float("inf")
    for _ in range(repetitions):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        best = min(best, time.perf_counter() - start)
        best_cpu = min(best_cpu, time.process_time() - start_cpu)
    return best, best_cpu


def run_shape(tokens, k, target_layers, repetitions, generator, weight_dtype):
    def randn(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, generator=generator) * scale).to(dtype)

    source_k = [randn(HEADS, tokens, HEAD_DIM) for _ in range(k)]
    source_v = [randn(HEADS, tokens, HEAD_DIM) for _ in range(k)]
    inputs = k * WIDTH
    weights = [(randn(inputs, WIDTH, scale=inputs ** -0.5, dtype=weight_dtype),
                randn(WIDTH, scale=0.5).float(),
                randn(inputs, WIDTH, scale=inputs ** -0.5, dtype=weight_dtype),
                randn(WIDTH, scale=0.5).float())
               for _ in range(target_layers)]
    sigma = [[(j + l) % k for j in range(k)] for l in range(target_layers)]
    target_k = [torch.empty(HEADS, tokens, HEAD_DIM, dtype=torch.bfloat16)
                for _ in range(target_layers)]
    target_v = [torch.empty_like(t) for t in target_k]
    flops = 2.0 * tokens * inputs * WIDTH * 2 * target_layers

    with torch.inference_mode():
        seconds, cpu_seconds = best_seconds(
            lambda: translate(source_k, source_v, weights, sigma, tokens, target_k, target_v),
            repetitions)
        a = randn(tokens, inputs, dtype=weight_dtype)
        bs = [w for layer in weights for w in (layer[0], layer[2])]
        matmul_seconds, matmul_cpu = best_seconds(lambda: [a @ b for b in bs], repetitions)
    return (tokens / seconds, flops / seconds / 1e9, flops / matmul_seconds / 1e9,
            cpu_seconds * 1e3, matmul_cpu * 1e3)


VARIANTS = {"bf16": torch.bfloat16, "fp32": torch.float32}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="512/2/4,512/4/4,4096/2/2,4096/4/2",
                        help="comma-separated T/k/L_t")
    parser.add_argument("--weights", default="bf16,fp32",
                        help="comma-separated weight variants: bf16, fp32")
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0 = every core")
    args = parser.parse_args()
    variants = args.weights.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"--weights: unknown variant(s) {unknown}; choose from {sorted(VARIANTS)}")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"mkldnn bf16 {torch.backends.mkldnn.is_available()}, cpu {os.cpu_count()} logical; "
          f"capability: {torch.backends.cpu.get_cpu_capability()}")
    # cpu ms: least process CPU time of one translation (all threads; OpenMP spin-waits count),
    # which a busy shared machine disturbs much less than wall time.
    print(f"{'T/k/L_t':<12} {'weights':>7} {'eager tok/s':>12} {'eager GF/s':>11} "
          f"{'mm GF/s':>8} {'eager/mm':>9} {'eager cpu ms':>13} {'mm cpu ms':>10}")
    generator = torch.Generator().manual_seed(0)
    faster = []
    for shape in args.shapes.split(","):
        tokens, k, target_layers = (int(v) for v in shape.split("/"))
        cpu_by_variant = {}
        for variant in variants:
            tps, gflops, mm, cpu_ms, mm_cpu_ms = run_shape(
                tokens, k, target_layers, args.repetitions, generator, VARIANTS[variant])
            cpu_by_variant[variant] = cpu_ms
            print(f"{shape:<12} {variant:>7} {tps:>12.0f} {gflops:>11.1f} {mm:>8.1f} "
                  f"{gflops / mm:>9.3f} {cpu_ms:>13.1f} {mm_cpu_ms:>10.1f}", flush=True)
        best = min(cpu_by_variant, key=cpu_by_variant.get)
        faster.append(f"{shape}: {best} ({cpu_by_variant[best]:.1f} cpu ms)")
    print("faster variant by CPU time: " + "; ".join(faster))


if __name__ == "__main__":
    main()
