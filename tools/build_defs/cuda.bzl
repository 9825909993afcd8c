"""CUDA code in the Bazel build: nvcc (from the toolkit @local_cuda found) compiles .cu files in a
genrule into a static archive, wrapped as a cc_library. Where the toolkit is absent the library
is empty and defines KVT_HAVE_CUDA=0, so `bazel build //...` passes without it.

SASS for sm_80 (A100) and sm_90 (H100/H200), plus compute_90 PTX for newer GPUs to JIT.
"""

load("@local_cuda//:defs.bzl", "CUDA_AVAILABLE", "NVCC")

NVCC_FLAGS = [
    "-std=c++17",
    "-O3",
    "-Xcompiler=-fPIC",
    "-gencode=arch=compute_80,code=sm_80",
    "-gencode=arch=compute_90,code=[sm_90,compute_90]",
    "--expt-relaxed-constexpr",
]

def kvt_cuda_library(name, cu_srcs, hdrs = [], srcs = [], deps = [], cu_inputs = [], visibility = None):
    """A cc_library whose .cu sources nvcc compiles; empty without the CUDA toolkit.

    cu_inputs: headers from other packages that the .cu files include (nvcc runs sandboxed).
    """
    if CUDA_AVAILABLE:
        archive = "lib" + name + "_cu.a"
        objects = [s[:-len(".cu")] + ".o" for s in cu_srcs]
        pkg = native.package_name()
        compile = " && ".join([
            "{nvcc} {flags} -I. -I$(GENDIR) -c {pkg}/{src} -o $(@D)/{obj}".format(
                nvcc = NVCC,
                flags = " ".join(NVCC_FLAGS),
                pkg = pkg,
                src = src,
                obj = obj,
            )
            for src, obj in zip(cu_srcs, objects)
        ])
        native.genrule(
            name = name + "_nvcc",
            srcs = cu_srcs + cu_inputs + [h for h in native.glob(["**/*.h", "**/*.cuh"]) if h not in cu_srcs],
            outs = [archive],
            cmd = compile + " && ar rcs $@ " + " ".join(["$(@D)/" + o for o in objects]),
            message = "nvcc " + name,
        )
        # The archive is a library of its own that the host code depends on, so it comes after
        # the host objects on the link line and their calls into the .cu files resolve.
        native.cc_library(
            name = name + "_cu",
            srcs = [archive],
            deps = ["@local_cuda//:cudart"],
            visibility = ["//visibility:private"],
        )
        native.cc_library(
            name = name,
            srcs = srcs,
            hdrs = hdrs,
            defines = ["KVT_HAVE_CUDA=1"],
            deps = deps + [":" + name + "_cu", "@local_cuda//:cudart"],
            visibility = visibility,
        )
    else:
        native.cc_library(
            name = name,
            srcs = srcs,
            hdrs = hdrs,
            defines = ["KVT_HAVE_CUDA=0"],
            deps = deps,
            visibility = visibility,
        )
