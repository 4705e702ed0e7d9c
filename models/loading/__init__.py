"""Weights in: Hugging Face safetensors (hf, hf_config), GGUF (gguf), orbax (checkpoint),
llm-compressor's compressed-tensors, straight into the devices' shardings (placed_weights,
lazy_model, quantized_loading), the checkpoint names they share (names) and what
`pagedjax inspect` reports without loading (inspect). Imports point one way: inspect -> gguf ->
placed_weights -> hf -> names."""
