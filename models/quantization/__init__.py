"""Weight quantization: the schemes and their stored form (schemes: int8, fp8, int4; QArray),
GGUF's block formats served as stored (gguf_blocks), and the quality a scheme keeps against the
float model (quality). The quantized modules are layers (pagedjax.models.layers.quantized)."""
