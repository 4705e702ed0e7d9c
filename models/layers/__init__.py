"""The layers every family is built from: linear / norms / RoPE / MLP (basic), attention over the
paged cache, mixtures of experts and their expert kernels, the quantized modules, and the KV
cache groups a model's attention windows form."""
