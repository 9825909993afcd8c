"""Repository rule that probes the CUDA toolkit at build time.

Generates @local_cuda with:
  :defs.bzl  CUDA_AVAILABLE (bool), NVCC (path), CUDA_PATH
  :headers   the toolkit's include tree (cuda_runtime.h, cublas_v2.h, nv/ without extension)
  :cudart, :cublas  link flags against the toolkit's shared libraries
When the toolkit is absent, the same targets exist but are empty and CUDA_AVAILABLE is False,
so `bazel build //...` passes on machines without CUDA.
"""

def _cuda_configure_impl(ctx):
    cuda_path = ctx.os.environ.get("KVT_CUDA_PATH", "/usr/local/cuda")
    nvcc = ctx.path(cuda_path + "/bin/nvcc")
    header = ctx.path(cuda_path + "/include/cuda_runtime.h")
    available = nvcc.exists and header.exists and ctx.os.environ.get("KVT_DISABLE_CUDA", "") != "1"
    if available:
        ctx.symlink(cuda_path + "/include", "include")
        lib_dir = cuda_path + "/lib64"
        ctx.file("BUILD.bazel", """
package(default_visibility = ["//visibility:public"])

cc_library(
    name = "headers",
    hdrs = glob(["include/**/*.h", "include/**/*.hpp", "include/**/*.cuh", "include/nv/**"]),
    includes = ["include"],
)

cc_library(
    name = "cudart",
    linkopts = ["-L{lib}", "-Wl,-rpath,{lib}", "-lcudart"],
    deps = [":headers"],
)

cc_library(
    name = "cublas",
    linkopts = ["-L{lib}", "-Wl,-rpath,{lib}", "-lcublas", "-lcublasLt"],
    deps = [":cudart"],
)

exports_files(["defs.bzl"])
""".format(lib = lib_dir))
    else:
        ctx.file("BUILD.bazel", """
package(default_visibility = ["//visibility:public"])

cc_library(name = "headers")

cc_library(name = "cudart")

cc_library(name = "cublas")

exports_files(["defs.bzl"])
""")
    ctx.file("defs.bzl", "CUDA_AVAILABLE = {avail}\nCUDA_PATH = \"{path}\"\nNVCC = \"{nvcc}\"\n".format(
        avail = "True" if available else "False",
        path = cuda_path,
        nvcc = str(nvcc) if available else "",
    ))

cuda_configure = repository_rule(
    implementation = _cuda_configure_impl,
    environ = ["KVT_CUDA_PATH", "KVT_DISABLE_CUDA"],
    local = True,
)
