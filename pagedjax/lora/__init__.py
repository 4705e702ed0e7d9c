"""LoRA adapters over the engine's base model (issue 53): LoRARequest and the limits (request),
PEFT directories read, checked and written (peft_adapter), the device slots and their one
compiled write (slot_weights), the known adapters, host cache and versions (manager),
add / remove / update_lora on the engine (engine_loras), and LoRA training in JAX over the
engine's own model classes (training)."""
