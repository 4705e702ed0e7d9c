"""Weight quantization: the schemes and their stored form (schemes: int8, fp8, int4; QArray) and
GGUF's block formats served as stored (gguf_blocks). The quantized modules are layers
(pagedjax.models.layers.quantized); the quality a scheme keeps against the float model is
measured with the dense path (pagedjax.models.training.quantization_quality)."""
