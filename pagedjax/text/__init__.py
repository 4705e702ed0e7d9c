"""Text: tokenizers (Hugging Face directories, GGUF, the embedded byte vocabulary), chat templates, streaming detokenization, stop strings."""
