#!/usr/bin/env python3
"""The GPU parity checks' expected false failures, simulated before a GPU runs them.

Models, in numpy, the rounding of each CUDA path of kernels/cuda (cuda_plan.h GemmDType: the
stripped source X is rounded to the GEMM dtype, bf16 or fp16 only when cache, weights and output
all have it, else fp32; cuBLAS accumulates in fp32, no TF32; MLP hidden activations are written
in the GEMM dtype; bias, target RoPE and the output rounding in fp32) and of the CPU backend's
paths (sgemm: fp32 throughout; oneDNN bf16 on AVX-512 BF16 / AMX hosts: X, weights and hidden
activations rounded to bf16), against the float64 reference, on the conformance suite's case
classes (kernels/testing/backend_conformance.cc) and the CUDA tests' own shapes. Each draw is
checked as kernels/cuda/cuda_backend_test.cc checks it:

  new harness: CUDA vs reference <= the suite's tolerance (its bf16 / fp16 GEMM exceptions where
               CUDA's GEMM reads that dtype), CUDA vs CPU sgemm <= that + SPEC 3's of the output;
  old harness: CUDA vs reference <= SPEC 3's, CUDA vs the CPU's automatic path (oneDNN bf16 for
               bf16 / fp16 weights on such a host) <= 2 x SPEC 3's.

Every draw is a correct translation, so each failed check is a false failure. RoPE is modelled
as full-width rotation pairs with fp32 cos/sin tables (rounding only; the pairing is tested on
the CPU). Prints one row per class and a total; exit 1 if the new harness has any false failure.

    python3 tests/gpu/simulate_parity.py [--draws N] [--seed S]     (needs numpy)
"""
import argparse
import sys

import numpy as np

TOL = {"fp32": 1e-5, "fp16": 1e-3, "bf16": 1e-2}  # SPEC 3, kernels/reference.cc


def bf16(x):
    """Round-to-nearest-even to bfloat16, returned as float32."""
    b = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.astype(np.uint32).view(np.float32)


def rnd(x, dtype):
    if dtype == "bf16":
        return bf16(x)
    if dtype == "fp16":
        return np.asarray(x, dtype=np.float32).astype(np.float16).astype(np.float32)
    return np.asarray(x, dtype=np.float32)


def gemm_dtype(cache_in, weights, out):
    return cache_in if cache_in == weights == out and cache_in != "fp32" else "fp32"


def max_rel_error(actual, expected):
    return np.max(np.abs(actual - expected)) / np.max(np.abs(expected))


class Rope:
    """Rotation pairs at positions; fp32 tables (the backends') or float64 (the reference)."""

    def __init__(self, rng, tokens, width, offset):
        pairs = width // 2
        inv_freq = 1.0 / (10000.0 ** (np.arange(pairs) / pairs))
        positions = offset + np.arange(tokens)[:, None]
        phi = positions * inv_freq[None, :]
        self.cos64, self.sin64 = np.cos(phi), np.sin(phi)
        self.cos32, self.sin32 = self.cos64.astype(np.float32), self.sin64.astype(np.float32)

    def apply(self, x, inverse, exact):
        cos, sin = (self.cos64, self.sin64) if exact else (self.cos32, self.sin32)
        if inverse:
            sin = -sin
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2] = a * cos - b * sin
        out[..., 1::2] = a * sin + b * cos
        return out


def draw_map(rng, c, width_in, width_out):
    """Weights of one (target layer, kind) in the weight dtype: ridge (W, b) or an MLP chain."""
    w = c["weights"]
    normal = lambda shape, std: rnd(rng.normal(0, std, shape), w).astype(np.float64)
    if c["kind"] == "ridge":
        return [normal((width_in, width_out), 1 / np.sqrt(width_in)),
                normal((width_out,), 0.5) if c.get("bias", True) else np.zeros(width_out)]
    heads = c["out_heads"] if c["per_head"] else 1
    h, out = c["hidden"], width_out // heads
    return [[normal((width_in, h), 1 / np.sqrt(width_in)), normal((h,), 0.5),
             normal((h, h), np.sqrt(2 / h)), normal((h,), 0.5),
             normal((h, out), np.sqrt(2 / h)), normal((out,), 0.5)] for _ in range(heads)]


def translate(x, weights, c, gemm, exact):
    """y = map(x) before the target RoPE: float64 (`exact`) or fp32 with `gemm`-dtype operands."""
    if exact:
        if c["kind"] == "ridge":
            return x @ weights[0] + weights[1]
        return np.concatenate([np.maximum(np.maximum(x @ a1 + c1, 0) @ a2 + c2, 0) @ a3 + c3
                               for a1, c1, a2, c2, a3, c3 in weights], axis=-1)
    f32 = lambda m: rnd(m, gemm)
    xg = f32(x)
    if c["kind"] == "ridge":
        return xg @ f32(weights[0]) + weights[1].astype(np.float32)
    outs = []
    for a1, c1, a2, c2, a3, c3 in weights:
        h1 = f32(np.maximum(xg @ f32(a1) + c1.astype(np.float32), 0))
        h2 = f32(np.maximum(h1 @ f32(a2) + c2.astype(np.float32), 0))
        outs.append(h2 @ f32(a3) + c3.astype(np.float32))
    return np.concatenate(outs, axis=-1)


def one_draw(rng, c):
    """(new-harness failures, old-harness failures, worst error / tolerance) of one case draw."""
    tokens, k = c["tokens"], c["k"]
    width_in, width_out = k * c["src_width"], c["out_heads"] * c["out_dim"]
    src = rnd(rng.normal(0, 1, (tokens, width_in)), c["in"]).astype(np.float64)
    offset = int(rng.integers(0, 2_000_000)) if c.get("large_positions") else 40
    strip, apply = Rope(rng, tokens, width_in, offset), Rope(rng, tokens, width_out, offset)
    x64 = strip.apply(src, True, True)
    x32 = strip.apply(src.astype(np.float32), True, False)
    out = c["out"]
    gpu_gemm = gemm_dtype(c["in"], c["weights"], out)
    # The suite's tolerance for CUDA (cuda_backend_test.cc CudaTolerance).
    tol = c.get(f"{gpu_gemm}_gemm_tolerance", 0) or TOL[out]
    new_fail = old_fail = 0
    worst = 0.0
    for _ in range(2 * c["layers"]):  # K and V of every target layer
        weights = draw_map(rng, c, width_in, width_out)
        ref = apply.apply(translate(x64, weights, c, None, True), False, True)
        finish = lambda y: rnd(apply.apply(y, False, False), out).astype(np.float64)
        gpu = finish(translate(x32, weights, c, gpu_gemm, False))
        sgemm = finish(translate(x32, weights, c, "fp32", False))
        onednn = c["weights"] in ("bf16", "fp16")  # the CPU's automatic path on an AMX host
        auto = finish(translate(x32, weights, c, "bf16", False)) if onednn else sgemm
        e_ref, e_sgemm, e_auto = (max_rel_error(gpu, ref), max_rel_error(gpu, sgemm),
                                  max_rel_error(gpu, auto))
        worst = max(worst, e_ref / tol, e_sgemm / (tol + TOL[out]))
        new_fail |= e_ref > tol or e_sgemm > tol + TOL[out]
        old_fail |= e_ref > TOL[out] or e_auto > 2 * TOL[out]
    return new_fail, old_fail, worst


def split_draw(rng, tokens=150, width_in=64, width_out=32):
    """Split vs whole on the GPU: the same fp32 math, another blocking of the K sum."""
    x = rng.normal(0, 1, (tokens, width_in)).astype(np.float32)
    w = rng.normal(0, 1 / np.sqrt(width_in), (width_in, width_out)).astype(np.float32)
    whole = x @ w
    split = sum(x[:, i:i + 16] @ w[i:i + 16] for i in range(0, width_in, 16))
    return max_rel_error(split.astype(np.float64), whole.astype(np.float64)) / TOL["fp32"]


def classes():
    """The case classes of the conformance suite and the CUDA tests, as the GPU runs them."""
    small = dict(kind="ridge", layers=2, k=1, src_width=32, out_heads=2, out_dim=16, tokens=37,
                 per_head=False)
    out = []
    for i in ("fp32", "bf16", "fp16"):
        for o in ("fp32", "bf16", "fp16"):
            for w in ("fp32", "bf16", "fp16"):
                out.append((f"EveryDtypeLayoutAndWeightDtype {i}->{o} w={w}",
                            dict(small, **{"in": i, "out": o, "weights": w}, out_heads=3,
                                 out_dim=8, tokens=19)))
    out.append(("NewCase ridge bf16 caches (rope, bias, positions)",
                dict(small, **{"in": "bf16", "out": "bf16", "weights": "fp32"}, k=2,
                     large_positions=True)))
    out.append(("UnmatchedShapes / SeparateSigma / Chunks fp32",
                dict(small, **{"in": "fp32", "out": "fp32", "weights": "fp32"}, k=3,
                     src_width=32, out_heads=3, out_dim=8, tokens=65)))
    for per_head in (False, True):
        for hidden in (1, 8, 37):
            for k in (1, 2, 3):
                for d in ("fp32", "bf16"):
                    out.append((f"MlpBothGranularities {'per_head' if per_head else 'per_layer'} "
                                f"H={hidden} k={k} {d}",
                                dict(small, kind="mlp", per_head=per_head, hidden=hidden,
                                     k=k, out_heads=3, out_dim=8, tokens=45,
                                     **{"in": d, "out": d, "weights": d},
                                     bf16_gemm_tolerance={1: 5e-2, 8: 2e-2}.get(hidden, 0))))
        for w in ("fp32", "bf16"):
            for io in ("fp32", "bf16", "fp16"):
                out.append((f"MlpDtypesLayoutsAndChunks {'per_head' if per_head else 'per_layer'}"
                            f" w={w} io={io}",
                            dict(small, kind="mlp", per_head=per_head, hidden=24, k=2,
                                 tokens=101, **{"in": io, "out": io, "weights": w})))
        for w, i, o in (("bf16", "fp32", "fp32"), ("fp16", "fp16", "fp16"),
                        ("bf16", "bf16", "fp32"), ("fp32", "bf16", "bf16")):
            out.append((f"MlpMixedDtypesConvertWeights {'per_head' if per_head else 'per_layer'}"
                        f" w={w} {i}->{o}",
                        dict(small, kind="mlp", per_head=per_head, hidden=24, tokens=19,
                             **{"in": i, "out": o, "weights": w},
                             fp16_gemm_tolerance=2e-3 if w == o == "fp16" else 0)))
    for kind, hidden in (("ridge", 0), ("mlp", 16)):
        out.append((f"WindowMappersBf16 {kind}",
                    dict(small, kind=kind, hidden=hidden, k=6, tokens=40,
                         **{"in": "bf16", "out": "bf16", "weights": "bf16"})))
    real = dict(kind="ridge", layers=1, k=3, src_width=1024, out_heads=8, out_dim=128,
                tokens=48, per_head=False, **{"in": "bf16", "out": "bf16", "weights": "bf16"})
    out.append(("RealHeadShapesBf16 8x128 k=3 (48 tokens)", dict(real, heavy=True)))
    out.append(("MlpRealHeadShapesBf16 per_layer H=1024 (16 tokens)",
                dict(real, kind="mlp", hidden=1024, tokens=16, heavy=True)))
    out.append(("MlpRealHeadShapesBf16 per_head H=256 (16 tokens)",
                dict(real, kind="mlp", per_head=True, hidden=256, tokens=16, heavy=True)))
    out.append(("benchmark value check qwen3-14b-to-32b k=8 ridge (32 tokens at 32K)",
                dict(real, k=8, tokens=32, large_positions=True, heavy=True)))
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--draws", type=int, default=200, help="draws per small case class")
    parser.add_argument("--heavy_draws", type=int, default=8, help="draws per real-shape class")
    parser.add_argument("--seed", type=int, default=20261206)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    total = new_total = old_total = 0
    print(f"{'class':<72} {'draws':>5} {'new':>4} {'old':>4} {'worst/tol':>9}")
    for name, c in classes():
        draws = args.heavy_draws if c.get("heavy") else args.draws
        new = old = 0
        worst = 0.0
        for _ in range(draws):
            n, o, w = one_draw(rng, c)
            new, old, worst = new + n, old + o, max(worst, w)
        total, new_total, old_total = total + draws, new_total + new, old_total + old
        print(f"{name:<72} {draws:>5} {new:>4} {old:>4} {worst:>9.3f}")
    split = max(split_draw(rng) for _ in range(args.draws))
    print(f"{'SplitTranslationEqualsWhole fp32 (split vs whole)':<72} {args.draws:>5} "
          f"{int(split > 1):>4} {'':>4} {split:>9.3f}")
    new_total += int(split > 1)
    print(f"\ntotal: {total} draws; false failures: new harness {new_total} "
          f"({100.0 * new_total / total:.2f}%), old harness {old_total} "
          f"({100.0 * old_total / total:.1f}%)")
    return 1 if new_total else 0


if __name__ == "__main__":
    sys.exit(main())
