"""Muse Glimmer target and DFlash drafter models (PyTorch, export-ready)."""
