"""Checks of an export against its source checkpoints, beside the reference runtime (runtime/):

parity   one exported function, run by the numpy interpreter, against eager PyTorch
verify   every function's parity, then speculative decoding over the exported packages that
         must equal the target's own greedy decoding (`./bazelw run //:verify`)
"""
