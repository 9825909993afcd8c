"""C++ code generation for .proto files with Debian's protoc and grpc_cpp_plugin.

Bazel 4's native cc_proto_library would build protobuf from source (a download); this macro runs
the system /usr/bin/protoc in a genrule instead, proto paths relative to the workspace root, so
generated headers are included as "proto/kvt/v1/foo.pb.h".
"""

def kvt_cc_grpc_library(name, srcs, deps = [], grpc_services = True, visibility = None):
    """Generates <src>.pb.{h,cc} (+ .grpc.pb.{h,cc}) for each proto in srcs and wraps them."""
    outs_h = []
    outs_cc = []
    for src in srcs:
        base = src[:-len(".proto")]
        outs_h.append(base + ".pb.h")
        outs_cc.append(base + ".pb.cc")
        if grpc_services:
            outs_h.append(base + ".grpc.pb.h")
            outs_cc.append(base + ".grpc.pb.cc")

    pkg = native.package_name()
    plugin = "--plugin=protoc-gen-grpc=/usr/bin/grpc_cpp_plugin --grpc_out=$(GENDIR) " if grpc_services else ""
    native.genrule(
        name = name + "_codegen",
        srcs = srcs + [d + "_protos" for d in deps],
        outs = outs_h + outs_cc,
        cmd = "/usr/bin/protoc -I. -I/usr/include --cpp_out=$(GENDIR) " + plugin +
              " ".join([pkg + "/" + s for s in srcs]),
        message = "protoc " + name,
    )
    native.filegroup(
        name = name + "_protos",
        srcs = srcs,
        visibility = visibility,
    )
    native.cc_library(
        name = name,
        srcs = outs_cc,
        hdrs = outs_h,
        deps = deps + ["//third_party:grpc", "//third_party:protobuf"],
        visibility = visibility,
    )
