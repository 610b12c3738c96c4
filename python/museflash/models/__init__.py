"""Target models (Muse Glimmer; Qwen3 and Llama 3.1 in transformers' layouts) and the DFlash
drafters (PyTorch, export-ready)."""
