"""LoRA adapters over the engine's base model (issue 53): Hugging Face PEFT directories read and
checked (peft_adapter)."""
