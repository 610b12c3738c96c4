"""The exporter, one module per stage, read top-down in `pipeline.export_bundle`:

options  -> what the user asked for, checked before anything else
plan     -> configs read and cross-checked once, every package and function decided
load     -> the modules to trace, with placeholders standing in for the large weights
            (placeholders)
convert  -> trace + convert one function into a single-function package
parallel -> the same conversions in helper processes
weights  -> meanwhile, the real weights (fp16 or compressed) written into each package's
            weight file on a thread (through blobfile, Core ML's weight file format)
merge    -> functions merged into one multifunction package, consts pointed at the weights
describe -> metadata.json (museflash.bundle types) and its embedded copies
publish  -> the staging directory swapped in atomically
"""
