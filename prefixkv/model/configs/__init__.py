"""Each model family's config readers (HF config.json -> ModelConfig fields, GGUF metadata ->
ModelConfig fields), one file a family, and the registry of which family reads which
architecture (registry.py)."""
