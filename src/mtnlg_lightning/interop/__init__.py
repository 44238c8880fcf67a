"""Getting models in and out: Hugging Face GPT-2 directories (export, import) and model sources for generation."""
