"""museflash: export Muse Glimmer and its DFlash drafter to Core ML."""

__version__ = "0.1.0"
