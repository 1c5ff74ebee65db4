"""Checkpoint conversion: Hugging Face safetensors -> Orbax, and GGUF -> Hugging Face layout."""
