"""Who may use the mapper store and its formats (docs/ARCHITECTURE.md, "Packages and layers"):
every package above kernels/; kernels/cuda for its benchmark only (scripts/check_layering.sh keeps
production kernels code off the store and the formats)."""

STORE_USERS = [
    "//cli:__pkg__",
    "//deploy:__pkg__",
    "//fit:__pkg__",
    "//fuzz:__pkg__",
    "//host_cache:__pkg__",
    "//kernels/cuda:__pkg__",
    "//loadtest:__pkg__",
    "//mapper_store:__subpackages__",
    "//prefix_cache:__pkg__",
    "//quality:__pkg__",
    "//server:__subpackages__",
    "//tests:__subpackages__",
]
