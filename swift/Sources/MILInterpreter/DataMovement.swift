/// Shape and data-movement kernels: each builds the source index of every output element and
/// picks, so one code path serves every element type.

func concatenate(_ values: [Tensor], axis given: Int) throws -> Tensor {
    guard let first = values.first else { throw KernelError("concat of nothing") }
    let axis = try normalizedAxis(given, rank: first.rank)
    for value in values where value.rank != first.rank
        || value.shape.enumerated().contains(where: { $0.offset != axis && $0.element != first.shape[$0.offset] }) {
        throw KernelError("concat of \(values.map(\.shape)) along axis \(axis)")
    }
    var shape = first.shape
    shape[axis] = values.reduce(0) { $0 + $1.shape[axis] }
    let outer = elementCount(Array(first.shape[..<axis]))
    let inner = elementCount(Array(first.shape[(axis + 1)...]))
    let anyFloat = values.contains { $0.type.isFloat }
    let type = anyFloat ? (values.first { $0.type.isFloat }?.type ?? .float32) : first.type
    func join<T>(_ arrays: [[T]]) -> [T] {
        var out: [T] = []
        out.reserveCapacity(elementCount(shape))
        for o in 0..<outer {
            for (array, value) in zip(arrays, values) {
                let run = value.shape[axis] * inner
                out.append(contentsOf: array[(o * run)..<((o + 1) * run)])
            }
        }
        return out
    }
    if anyFloat { return .floats(join(values.map { $0.floats() }), shape: shape, type: type) }
    if first.type == .bool { return .bools(join(values.map { $0.bools() }), shape: shape) }
    return .ints(join(values.map { $0.ints() }), shape: shape, type: type)
}

func slicePlan(shape: [Int], args: OpArguments) throws -> (shape: [Int], walk: StridedWalk) {
    let rank = shape.count
    let begin = try args.ints("begin"), end = try args.ints("end")
    let strides = try args.optionalInts("stride") ?? [Int](repeating: 1, count: rank)
    let beginMask = try args.optionalBools("begin_mask") ?? [Bool](repeating: false, count: rank)
    let endMask = try args.optionalBools("end_mask") ?? [Bool](repeating: false, count: rank)
    let squeezeMask = try args.optionalBools("squeeze_mask") ?? [Bool](repeating: false, count: rank)
    guard [begin.count, end.count, strides.count, beginMask.count, endMask.count, squeezeMask.count].allSatisfy({ $0 == rank }) else {
        throw KernelError("slice parameters do not all have rank \(rank)")
    }
    let sourceStrides = rowMajorStrides(shape)
    var base = 0
    var outShape: [Int] = []
    var outStrides: [Int] = []
    for axis in 0..<rank {
        if squeezeMask[axis] {
            var index = begin[axis]
            if index < 0 { index += shape[axis] }
            guard index >= 0, index < shape[axis] else { throw KernelError("index \(begin[axis]) out of range for axis \(axis) of \(shape)") }
            base += index * sourceStrides[axis]
            continue
        }
        let (first, count) = try sliceIndices(start: beginMask[axis] ? nil : begin[axis], stop: endMask[axis] ? nil : end[axis],
                                              step: strides[axis], size: shape[axis])
        base += first * sourceStrides[axis]
        outShape.append(count)
        outStrides.append(strides[axis] * sourceStrides[axis])
    }
    return (outShape, StridedWalk(shape: outShape, strides: outStrides, base: base))
}

/// `reshape`'s target: 0 copies the input dimension aligned from the right (iOS17), -1 is
/// inferred.
func reshapeTarget(_ requested: [Int], input: [Int]) throws -> [Int] {
    var shape = requested
    for (index, size) in shape.enumerated() where size == 0 {
        let aligned = input.count - (shape.count - index)
        shape[index] = aligned >= 0 ? input[aligned] : 1
    }
    let total = elementCount(input)
    if let unknown = shape.firstIndex(of: -1) {
        let known = shape.enumerated().filter { $0.offset != unknown }.reduce(1) { $0 * $1.element }
        guard known > 0, total % known == 0 else { throw KernelError("cannot reshape \(input) to \(requested)") }
        shape[unknown] = total / known
    }
    guard elementCount(shape) == total, !shape.contains(where: { $0 < 0 }) else {
        throw KernelError("cannot reshape \(input) to \(requested)")
    }
    return shape
}

/// A tensor of `shape` holding `value` (a scalar; 0.0 when absent) everywhere.
func filled(_ shape: [Int], with value: Tensor?) -> Tensor {
    let count = elementCount(shape)
    if let value = value, value.type.isInteger { return .ints([Int32](repeating: value.ints().first ?? 0, count: count), shape: shape) }
    if let value = value, value.type == .bool { return .bools([Bool](repeating: value.bools().first ?? false, count: count), shape: shape) }
    return .floats([Float](repeating: value?.floats().first ?? 0, count: count), shape: shape)
}

func checkedIndex(_ index: Int32, size: Int, op: String) throws -> Int {
    let value = Int(index)
    guard value >= -size, value < size else {
        throw KernelError("\(op) index \(value) out of range [\(-size), \(size))")
    }
    return value < 0 ? value + size : value
}

let dataMovementKernels: [String: Kernel] = [
    "reshape": { args in
        let x = try args.tensor("x")
        return [x.reshaped(try reshapeTarget(args.ints("shape"), input: x.shape))]
    },
    "expand_dims": { args in
        let x = try args.tensor("x")
        let axes = try args.ints("axes")
        let rank = x.rank + axes.count
        var shape = x.shape
        for axis in axes.map({ ($0 % rank + rank) % rank }).sorted() { shape.insert(1, at: min(axis, shape.count)) }
        return [x.reshaped(shape)]
    },
    "squeeze": { args in
        let x = try args.tensor("x")
        guard let axes = try args.optionalInts("axes") else { return [x.reshaped(x.shape.filter { $0 != 1 })] }
        let drop = Set(try axes.map { try normalizedAxis($0, rank: x.rank) })
        for axis in drop where x.shape[axis] != 1 { throw KernelError("cannot squeeze axis \(axis) of \(x.shape)") }
        return [x.reshaped(x.shape.enumerated().filter { !drop.contains($0.offset) }.map(\.element))]
    },
    "transpose": { args in
        let x = try args.tensor("x")
        let perm = try args.ints("perm").map { try normalizedAxis($0, rank: x.rank) }
        guard perm.sorted() == Array(0..<x.rank) else { throw KernelError("perm \(perm) for rank \(x.rank)") }
        return [transposed(x, perm: perm)]
    },
    "tile": { args in
        let x = try args.tensor("x")
        let reps = try args.ints("reps")
        guard reps.count == x.rank else { throw KernelError("tile reps \(reps) for rank \(x.rank)") }
        let shape = zip(x.shape, reps).map { $0 * $1 }
        let strides = rowMajorStrides(x.shape)
        if zip(x.shape, reps).allSatisfy({ $0 == 1 || $1 == 1 }) {
            // Repeating only size-1 axes is a broadcast: those axes step by 0.
            return [x.strided(shape, strides: zip(x.shape, strides).map { $0 == 1 ? 0 : $1 }, base: 0)]
        }
        // Output index -> source index: each coordinate modulo the source size.
        var indices = [Int](repeating: 0, count: elementCount(shape))
        let outStrides = rowMajorStrides(shape)
        for position in 0..<indices.count {
            var rest = position, source = 0
            for axis in 0..<shape.count {
                let coordinate = rest / outStrides[axis]
                rest %= outStrides[axis]
                source += (coordinate % x.shape[axis]) * strides[axis]
            }
            indices[position] = source
        }
        return [x.picking(indices, shape: shape)]
    },
    "concat": { args in
        let values = try args.list("values")
        let axis = try args.int("axis")
        if try args.bool("interleave") {
            guard let first = values.first else { throw KernelError("concat of nothing") }
            let normalized = try normalizedAxis(axis, rank: first.rank)
            // Stack along a new axis after `axis`, then merge the two.
            let expanded = values.map { value -> Tensor in
                var shape = value.shape
                shape.insert(1, at: normalized + 1)
                return value.reshaped(shape)
            }
            let stacked = try concatenate(expanded, axis: normalized + 1)
            var shape = first.shape
            shape[normalized] *= values.count
            return [stacked.reshaped(shape)]
        }
        return [try concatenate(values, axis: axis)]
    },
    "stack": { args in
        let values = try args.list("values")
        guard let first = values.first else { throw KernelError("stack of nothing") }
        let axis = try args.int("axis")
        let normalized = axis < 0 ? axis + first.rank + 1 : axis
        let expanded = values.map { value -> Tensor in
            var shape = value.shape
            shape.insert(1, at: normalized)
            return value.reshaped(shape)
        }
        return [try concatenate(expanded, axis: normalized)]
    },
    "split": { args in
        let x = try args.tensor("x")
        let axis = try normalizedAxis(args.int("axis"), rank: x.rank)
        let sizes: [Int]
        if let given = try args.optionalInts("split_sizes") {
            sizes = given
        } else {
            let parts = try args.int("num_splits")
            guard parts > 0, x.shape[axis] % parts == 0 else { throw KernelError("cannot split \(x.shape[axis]) into \(parts)") }
            sizes = [Int](repeating: x.shape[axis] / parts, count: parts)
        }
        guard sizes.reduce(0, +) == x.shape[axis] else { throw KernelError("split sizes \(sizes) for axis size \(x.shape[axis])") }
        let strides = rowMajorStrides(x.shape)
        var start = 0
        return sizes.map { size in
            var shape = x.shape
            shape[axis] = size
            let part = x.strided(shape, strides: strides, base: start * strides[axis])
            start += size
            return part
        }
    },
    "slice_by_index": { args in
        let x = try args.tensor("x")
        let plan = try slicePlan(shape: x.shape, args: args)
        return [Tensor(shape: plan.shape, type: x.type, data: x.data.gathering(plan.walk))]
    },
    "slice_by_size": { args in
        let x = try args.tensor("x")
        let begin = try args.ints("begin"), size = try args.ints("size")
        guard begin.count == x.rank, size.count == x.rank else { throw KernelError("slice_by_size parameters for rank \(x.rank)") }
        let strides = rowMajorStrides(x.shape)
        var base = 0
        var shape: [Int] = []
        for axis in 0..<x.rank {
            let dim = x.shape[axis]
            let start = ((begin[axis] % dim) + dim) % dim
            let count = size[axis] == -1 ? dim - start : size[axis]
            guard count >= 0, start + count <= dim else { throw KernelError("slice_by_size past axis \(axis) of \(x.shape)") }
            base += start * strides[axis]
            shape.append(count)
        }
        return [x.strided(shape, strides: strides, base: base)]
    },
    "slice_update": { args in
        // Moved in when this op is x's last reader: then the values below are unique and the
        // write costs the update's size, not x's (CompiledFunction.planInPlaceUpdates).
        var x = try args.takeTensor("x")
        let update = try args.tensor("update")
        let plan = try slicePlan(shape: x.shape, args: args)
        guard update.count == plan.walk.count else {
            throw KernelError("update \(update.shape) for a slice of \(plan.walk.count) elements")
        }
        // The kind first: a switch over x.data itself could keep its values referenced.
        let isInt: Bool, isBool: Bool
        if case .int = x.data { isInt = true } else { isInt = false }
        if case .bool = x.data { isBool = true } else { isBool = false }
        if isInt {
            var values = x.takeInts()
            let source = update.ints()
            values.withUnsafeMutableBufferPointer { target in
                source.withUnsafeBufferPointer { plan.walk.scatter($0, into: target) { x.type.wrap($0) } }
            }
            return [.ints(values, shape: x.shape, type: x.type)]
        } else if isBool {
            var values = x.takeBools()
            let source = update.bools()
            values.withUnsafeMutableBufferPointer { target in
                source.withUnsafeBufferPointer { plan.walk.scatter($0, into: target) { $0 } }
            }
            return [.bools(values, shape: x.shape)]
        } else {
            var values = x.takeFloats()
            var source = update.floats()
            // Rounded in one vectorized pass (a copy of the update's values, not of x), then
            // copied: the same values as `Half.round` of each element as it is written.
            if x.type == .float16 { Half.roundInPlace(&source) }
            values.withUnsafeMutableBufferPointer { target in
                source.withUnsafeBufferPointer { plan.walk.scatter($0, into: target) { $0 } }
            }
            return [.floats(values, shape: x.shape, type: x.type)]
        }
    },
    "gather": { args in
        let x = try args.tensor("x"), indices = try args.tensor("indices")
        let axis = try normalizedAxis(args.int("axis", default: 0), rank: x.rank)
        guard try args.int("batch_dims", default: 0) == 0 else { throw KernelError("gather with batch_dims != 0 is not supported") }
        let view = AxisView(shape: x.shape, axis: axis)
        let picks = try indices.ints().map { try checkedIndex($0, size: view.size, op: "gather") }
        var sources: [Int] = []
        sources.reserveCapacity(view.outer * picks.count * view.inner)
        for o in 0..<view.outer {
            for pick in picks {
                let base = (o * view.size + pick) * view.inner
                for i in 0..<view.inner { sources.append(base + i) }
            }
        }
        let shape = Array(x.shape[..<axis]) + indices.shape + Array(x.shape[(axis + 1)...])
        return [x.picking(sources, shape: shape)]
    },
    "gather_along_axis": { args in
        let x = try args.tensor("x"), indices = try args.tensor("indices")
        let axis = try normalizedAxis(args.int("axis", default: 0), rank: x.rank)
        guard indices.rank == x.rank else { throw KernelError("gather_along_axis indices \(indices.shape) for \(x.shape)") }
        let strides = rowMajorStrides(x.shape)
        let outStrides = rowMajorStrides(indices.shape)
        let values = indices.ints()
        var sources = [Int](repeating: 0, count: values.count)
        for position in 0..<values.count {
            var rest = position, source = 0
            for d in 0..<x.rank {
                let coordinate = rest / outStrides[d]
                rest %= outStrides[d]
                if d == axis {
                    source += try checkedIndex(values[position], size: x.shape[d], op: "gather_along_axis") * strides[d]
                } else {
                    guard coordinate < x.shape[d] else { throw KernelError("gather_along_axis indices \(indices.shape) for \(x.shape)") }
                    source += coordinate * strides[d]
                }
            }
            sources[position] = source
        }
        return [x.picking(sources, shape: indices.shape)]
    },
    "fill": { args in [filled(try args.ints("shape"), with: try args.optional("value"))] },
    "fill_like": { args in [filled(try args.tensor("ref_tensor").shape, with: try args.optional("value"))] },
    "range_1d": { args in
        let start = try args.tensor("start"), end = try args.tensor("end"), step = try args.tensor("step")
        if start.type.isFloat || end.type.isFloat || step.type.isFloat {
            let s = start.floats()[0], e = end.floats()[0], d = step.floats()[0]
            guard d != 0 else { throw KernelError("range_1d step 0") }
            let count = max(0, Int((Double(e - s) / Double(d)).rounded(.up)))
            return [.floats((0..<count).map { s + Float($0) * d }, shape: [count])]
        }
        let s = Int(start.ints()[0]), e = Int(end.ints()[0]), d = Int(step.ints()[0])
        guard d != 0 else { throw KernelError("range_1d step 0") }
        let values = Array(stride(from: s, to: e, by: d)).map { Int32($0) }
        return [.ints(values, shape: [values.count])]
    },
    "shape": { args in
        let x = try args.tensor("x")
        return [.ints(x.shape.map { Int32($0) }, shape: [x.rank])]
    },
    "read_state": { args in
        // A snapshot: value semantics keep it from changing when the state is written later.
        let name = try args.stateName("input")
        guard let value = args.states?.values[name] else { throw KernelError("state \(name) is not bound") }
        return [value]
    },
    "write_state": { args in
        // What coreml_update_state is saved as: a write with no outputs.
        let name = try args.stateName("input")
        let value = try args.tensor("data")
        guard let states = args.states, let current = states.values[name] else { throw KernelError("state \(name) is not bound") }
        guard value.shape == current.shape else { throw KernelError("writes \(value.shape) into state \(name) of \(current.shape)") }
        states.values[name] = value.converted(to: current.type)
        return []
    },
    "coreml_update_state": { args in
        let name = try args.stateName("state")
        let value = try args.tensor("value")
        guard let states = args.states, let current = states.values[name] else { throw KernelError("state \(name) is not bound") }
        guard value.shape == current.shape else { throw KernelError("writes \(value.shape) into state \(name) of \(current.shape)") }
        let stored = value.converted(to: current.type)
        states.values[name] = stored
        return [stored]
    },
]

/// Visits a tensor of `shape` cut into `grid` equal blocks along every axis run by run, in
/// row-major order: `body(start, count, block)` for the `count` consecutive elements from
/// `start` that lie in one block, `block` being its row-major index in the grid (which scale or
/// look-up table they read). A run is one block wide along the last axis, and each row's block
/// adds one term per axis: no element costs a division, and no index is stored per element (a
/// weight's decompression at load visits every element).
func forEachBlockRun(shape: [Int], grid: [Int], _ body: (_ start: Int, _ count: Int, _ block: Int) throws -> Void) throws {
    guard let last = shape.indices.last else { return try body(0, 1, 0) }
    guard elementCount(shape) > 0 else { return }
    let blocks = zip(shape, grid).map { $0 / $1 }
    let gridStrides = rowMajorStrides(grid)
    var start = 0
    func visit(axis: Int, base: Int) throws {
        if axis == last {
            for block in 0..<grid[axis] {
                try body(start, blocks[axis], base + block * gridStrides[axis])
                start += blocks[axis]
            }
            return
        }
        for coordinate in 0..<shape[axis] {
            try visit(axis: axis + 1, base: base + coordinate / blocks[axis] * gridStrides[axis])
        }
    }
    try visit(axis: 0, base: 0)
}

/// constexpr ops, evaluated once when a function is compiled.
let decompressors: [String: Kernel] = [
    "constexpr_blockwise_shift_scale": { args in
        let data = try args.tensor("data"), scale = try args.tensor("scale")
        let offset = try args.optional("offset")
        guard data.rank == scale.rank, zip(data.shape, scale.shape).allSatisfy({ $1 > 0 && $0 % $1 == 0 }) else {
            throw KernelError("scale \(scale.shape) does not tile data \(data.shape)")
        }
        if let offset = offset, offset.shape != scale.shape { throw KernelError("offset \(offset.shape) differs from scale \(scale.shape)") }
        let values = data.floats(), scales = scale.floats(), offsets = offset?.floats()
        // data - offset is computed in the scale's dtype, as coremltools' own decompression of
        // the op does: with fp16 scales and offsets it is rounded to fp16 before the product
        // (an integer minus an offset below 1 can need more than fp16's 11 bits).
        let halfShift = scale.type == .float16 && offset?.type == .float16
        let out = try [Float](unsafeUninitializedCapacity: values.count) { out, initialized in
            try forEachBlockRun(shape: data.shape, grid: scale.shape) { start, count, block in
                let factor = scales[block], subtrahend = offsets?[block]
                for position in start..<start + count {
                    var shifted = subtrahend.map { values[position] - $0 } ?? values[position]
                    if halfShift { shifted = Half.round(shifted) }
                    out[position] = shifted * factor
                }
            }
            initialized = values.count
        }
        return [.floats(out, shape: data.shape)]
    },
    "constexpr_lut_to_dense": { args in
        let indices = try args.tensor("indices"), lut = try args.tensor("lut")
        guard lut.rank == indices.rank + 2, lut.shape.last == 1 else {
            throw KernelError("look-up table \(lut.shape) for indices \(indices.shape) (only scalar tables are supported)")
        }
        let groups = Array(lut.shape[..<indices.rank])
        let entries = lut.shape[indices.rank]
        guard zip(indices.shape, groups).allSatisfy({ $1 > 0 && $0 % $1 == 0 }) else {
            throw KernelError("look-up table groups \(groups) do not tile indices \(indices.shape)")
        }
        let table = lut.floats(), picks = indices.ints()
        let out = try [Float](unsafeUninitializedCapacity: picks.count) { out, initialized in
            try forEachBlockRun(shape: indices.shape, grid: groups) { start, count, group in
                for position in start..<start + count {
                    let entry = Int(picks[position])
                    guard entry >= 0, entry < entries else { throw KernelError("index \(entry) past the \(entries)-entry table") }
                    out[position] = table[group * entries + entry]
                }
            }
            initialized = picks.count
        }
        return [.floats(out, shape: indices.shape)]
    },
]

let kernels: [String: Kernel] = elementwiseKernels
    .merging(linearAlgebraKernels) { a, _ in a }
    .merging(reductionKernels) { a, _ in a }
    .merging(dataMovementKernels) { a, _ in a }

/// Every op type the interpreter runs (besides `const` and the constexpr decompressions).
public let supportedOpTypes: Set<String> = Set(kernels.keys).union(decompressors.keys).union(["const"])
