#!/usr/bin/env python3
"""kvt's CPU translate next to the faster eager PyTorch variant and the fastest same-FLOPs GEMM,
in one run: the comparison docs/BENCHMARKS.md states its CPU goals against.

Runs kernels/cpu_backend_benchmark (JSON) on the shapes given, then tests/peers/
torch_eager_translate.py's bf16-weight and fp32-weight variants on the same shapes, and prints
per shape the least process CPU time of each (ms; a shared machine disturbs CPU time much less
than wall time) and the ratios:
  x GEMM:    the fastest same-FLOPs GEMM in the kvt process (bare oneDNN bf16 matmul or bare
             OpenBLAS sgemm, packed weights, no gather or epilogue) / kvt translate;
  x PyTorch: the faster PyTorch variant / kvt translate.

    bazel build -c opt //kernels:cpu_backend_benchmark
    .venv/bin/python tests/peers/compare_cpu_translate.py \\
        --benchmark=bazel-out/k8-opt/bin/kernels/cpu_backend_benchmark --shapes 512/2/4,4096/2/2
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch_eager_translate as peer  # noqa: E402  (a sibling script, not a package)

KVT_BENCHMARKS = ("BM_Translate", "BM_TranslateSgemmPath", "BM_Bf16MatmulSameFlops",
                  "BM_SgemmSameFlops")


def cpu_model():
    """"AMD EPYC (family 25 model 17; avx512_bf16)": the machine type the table belongs to."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                fields.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.processor()
    flags = set(fields.get("flags", "").split())
    extras = [f for f in ("avx512_bf16", "avx512_fp16", "amx_bf16") if f in flags]
    return (f"{fields.get('model name', '?')} (family {fields.get('cpu family', '?')} model "
            f"{fields.get('model', '?')}; {', '.join(extras) or 'no bf16 hardware'})")


def kvt_times(benchmark, shapes, repetitions):
    """{(name, shape): least process CPU ms} from the C++ benchmark's JSON, shapes as T/k/L."""
    alternatives = "|".join(f"{s}/0" for s in shapes)
    names = "|".join(KVT_BENCHMARKS)
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        command = [benchmark, f"--benchmark_filter=^({names})/({alternatives})/",
                   f"--benchmark_repetitions={repetitions}", f"--benchmark_out={out.name}",
                   "--benchmark_out_format=json", "--benchmark_enable_random_interleaving=true"]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        report = json.load(out)
    missing = [(name, shape) for name in KVT_BENCHMARKS for shape in shapes]
    times = {}
    for run in report["benchmarks"]:
        if run.get("run_type") != "iteration" or run.get("error_occurred"):
            continue
        # "BM_Translate/512/2/4/0/process_time/real_time": name, T, k, L, token chunk, ...
        parts = run["run_name"].split("/")
        name, shape = parts[0], "/".join(parts[1:4])
        assert run["time_unit"] == "ms", run["time_unit"]
        key = (name, shape)
        times[key] = min(times.get(key, float("inf")), run["cpu_time"])
    missing = [f"{name}/{shape}" for name, shape in missing if (name, shape) not in times]
    if missing:
        sys.exit(f"{benchmark} ran no {', '.join(missing)}: pick shapes it registers "
                 "(T/k/L with token chunk 0, kernels/cpu_backend_benchmark.cc RegisterShapes)")
    return times


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--benchmark", required=True, help="cpu_backend_benchmark binary (-c opt)")
    parser.add_argument("--shapes", default="512/2/4,512/4/4,4096/2/2,4096/4/2",
                        help="comma-separated T/k/L_t (T >= 512 for the goals)")
    parser.add_argument("--repetitions", type=int, default=3)
    args = parser.parse_args()
    shapes = args.shapes.split(",")
    kvt = kvt_times(args.benchmark, shapes, args.repetitions)
    generator = peer.torch.Generator().manual_seed(0)
    print(f"machine: {cpu_model()}, {os.cpu_count()} logical CPUs; torch "
          f"{peer.torch.__version__} ({peer.torch.get_num_threads()} threads)")
    print("least process CPU time per whole-cache translation, ms")
    print(f"{'T/k/L_t':<10} {'kvt':>8} {'kvt sgemm':>10} {'bf16 mm':>8} {'sgemm':>8} "
          f"{'torch bf16':>11} {'torch fp32':>11} {'x GEMM':>7} {'x PyTorch':>10}")
    for shape in shapes:
        tokens, k, layers = (int(v) for v in shape.split("/"))
        torch_ms = {}
        for variant, dtype in peer.VARIANTS.items():
            torch_ms[variant] = peer.run_shape(tokens, k, layers, args.repetitions, generator,
                                               dtype)[3]
        translate = kvt[("BM_Translate", shape)]
        gemm = min(kvt[("BM_Bf16MatmulSameFlops", shape)], kvt[("BM_SgemmSameFlops", shape)])
        best_torch = min(torch_ms.values())
        print(f"{shape:<10} {translate:>8.1f} {kvt[('BM_TranslateSgemmPath', shape)]:>10.1f} "
              f"{kvt[('BM_Bf16MatmulSameFlops', shape)]:>8.1f} "
              f"{kvt[('BM_SgemmSameFlops', shape)]:>8.1f} {torch_ms['bf16']:>11.1f} "
              f"{torch_ms['fp32']:>11.1f} {gemm / translate:>7.2f} "
              f"{best_torch / translate:>10.2f}", flush=True)


if __name__ == "__main__":
    main()
