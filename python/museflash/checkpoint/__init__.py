"""Muse Glimmer and DFlash checkpoints in the Hugging Face safetensors layout, one job a module:

tensor_files   reading (memory-mapped or streamed) and writing safetensors, CheckpointError
weight_values  which tensor values an fp16 package can hold (NaN, inf, beyond fp16's range)
configs        config.json parsed into the models' configs and checked, the drafter against
               the target included (`check_configs`: the one validation pass)
tokenizer      the target's tokenizer files, checked against the model
load           the target and drafter built from a checkpoint (`load_target`, `load_drafter`)

Which checkpoint key holds which parameter is each model's own (models/).
"""
