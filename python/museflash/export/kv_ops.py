"""How coremltools converts the models' custom KV ops (models/base.py `write_cache_rows`, and
`read_cache_rows` below).

`museflash::write_cache_rows(cache, layer, start, values)` becomes one `slice_update` of the
whole state tensor, begin [layer, 0, start, 0] and end [layer + 1, kv_heads, start + T,
head_dim], with `start` read from the position input at run time and clamped to
[0, capacity - T] as the eager op clamps it. Chained over the layers and written back by the
state's `coreml_update_state`, it is the pattern that a compiler can update in place: O(T) rows
per call, where the one-hot blend rewrites each whole layer (KVWrite.SLICE, docs/kv-write.md).

Importing this module registers the converter; export/convert.py imports it.
"""

from __future__ import annotations

import numpy as np
from coremltools.converters.mil import Builder as mb
from coremltools.converters.mil.frontend.torch.ops import _get_inputs
from coremltools.converters.mil.frontend.torch.torch_op_registry import register_torch_op
from coremltools.converters.mil.mil import types

OP_NAME = "museflash::write_cache_rows"
READ_OP_NAME = "museflash::read_cache_rows"


def first_slot(start, capacity: int, length: int):
    """[1] int32: the position input's first value, clamped so T rows fit the cache. A constant
    start (a context bucket's blend, written from slot 0: models/base.py write_cache_slots)
    gives a constant, so the slice_update's begin is constant: not runtime-indexed."""
    if start.val is not None:
        first = int(np.asarray(start.val).reshape(-1)[0])
        return np.array([min(max(first, 0), capacity - length)], np.int32)
    first = mb.reshape(x=start, shape=[1])
    return mb.maximum(x=mb.minimum(x=first, y=np.int32(capacity - length)), y=np.int32(0))


def write_rows(cache, layer: int, first, values, name: str):
    """cache with cache[layer][:, first : first + T] = values, as one slice_update."""
    _, kv_heads, _, head_dim = cache.shape
    length = values.shape[1]
    begin = mb.concat(values=[np.array([layer, 0], np.int32), first,
                              np.array([0], np.int32)], axis=0)
    last = (first + np.int32(length) if isinstance(first, np.ndarray)
            else mb.add(x=first, y=np.int32(length)))
    end = mb.concat(values=[np.array([layer + 1, kv_heads], np.int32), last,
                            np.array([head_dim], np.int32)], axis=0)
    update = mb.expand_dims(x=values, axes=[0])
    if update.dtype != cache.dtype:
        update = mb.cast(x=update, dtype=types.builtin_to_string(cache.dtype))
    return mb.slice_update(x=cache, update=update, begin=begin, end=end, name=name)


@register_torch_op(torch_alias=[OP_NAME])
def convert_write_cache_rows(context, node) -> None:
    cache, layer, start, values = _get_inputs(context, node, expected=4)
    first = first_slot(start, cache.shape[2], values.shape[1])
    context.add(write_rows(cache, int(layer.val), first, values, node.name))


@register_torch_op(torch_alias=[READ_OP_NAME])
def convert_read_cache_rows(context, node) -> None:
    """`museflash::read_cache_rows(cache, layer, length)`: one slice_by_index of the state,
    begin [layer, 0, 0, 0], end [layer + 1, kv_heads, length, head_dim], the layer axis
    squeezed (models/base.py, a context bucket's read of a layer)."""
    cache, layer, length = _get_inputs(context, node, expected=3)
    _, kv_heads, _, head_dim = cache.shape
    layer, length = int(layer.val), int(length.val)
    context.add(mb.slice_by_index(
        x=cache, begin=np.array([layer, 0, 0, 0], np.int32),
        end=np.array([layer + 1, kv_heads, length, head_dim], np.int32),
        squeeze_mask=[True, False, False, False], name=node.name))
