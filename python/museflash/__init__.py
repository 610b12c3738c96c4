"""museflash: export Muse Glimmer and its DFlash drafter to Core ML."""
