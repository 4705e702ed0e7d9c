"""GPU kernels: triton/ (backend 'gpu': Pallas' Triton lowering, any GPU JAX runs on) and mosaic/
(backend 'mosaic_gpu': Pallas' Mosaic GPU lowering, Hopper and newer), on one cache layout (head
dim padded to a power of two, layout.PADDED_HEAD_DIM_BACKENDS); common.py holds what both size
their kernels by and split-K decoding."""
