"""Getting models in and out: Hugging Face directories of GPT-2, Llama and Qwen 2/3 (export, import, read as a model
source) and their key mappings."""
