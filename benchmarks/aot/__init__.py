"""Ahead-of-time builds of the kernels for chips not at hand, outside the runtime package:
triton_gpu (Pallas -> Triton IR -> cubin with the triton package), xla_gpu (XLA's GPU compiler
for a compile-only device), xla_tpu (libtpu for a TPU topology, in a child process). The
compile benchmarks and tests/test_kernels_*_compile.py use them; nothing in pallas_kernels does."""
