/// Shape arithmetic shared by the kernels: row-major strides, numpy broadcasting, and index
/// maps that say which element of a source each output element reads.

@inline(__always)
func elementCount(_ shape: [Int]) -> Int { shape.reduce(1, *) }

func rowMajorStrides(_ shape: [Int]) -> [Int] {
    var strides = [Int](repeating: 1, count: shape.count)
    var running = 1
    for axis in stride(from: shape.count - 1, through: 0, by: -1) {
        strides[axis] = running
        running *= shape[axis]
    }
    return strides
}

func normalizedAxis(_ axis: Int, rank: Int) throws -> Int {
    let normalized = axis < 0 ? axis + rank : axis
    guard normalized >= 0, normalized < max(rank, 1) else {
        throw KernelError("axis \(axis) is out of range for rank \(rank)")
    }
    return normalized
}

/// numpy's broadcast of several shapes (aligned from the right).
func broadcastShape(_ shapes: [[Int]]) throws -> [Int] {
    let rank = shapes.map(\.count).max() ?? 0
    var result = [Int](repeating: 1, count: rank)
    for shape in shapes {
        let offset = rank - shape.count
        for (index, size) in shape.enumerated() {
            let current = result[offset + index]
            if current == size || size == 1 { continue }
            guard current == 1 else {
                throw KernelError("shapes \(shapes) do not broadcast")
            }
            result[offset + index] = size
        }
    }
    return result
}

/// For each element of a tensor of shape `output`, the index of the element of a tensor of
/// shape `input` that broadcasting reads; nil when the shapes are equal (the identity).
func broadcastIndices(from input: [Int], to output: [Int]) -> [Int]? {
    if input == output { return nil }
    let count = elementCount(output)
    if elementCount(input) == 1 { return [Int](repeating: 0, count: count) }
    let rank = output.count
    let padded = [Int](repeating: 1, count: rank - input.count) + input
    let inputStrides = rowMajorStrides(padded)
    var strides = [Int](repeating: 0, count: rank)
    for axis in 0..<rank where padded[axis] != 1 { strides[axis] = inputStrides[axis] }
    return strideIndices(shape: output, strides: strides, base: 0)
}

/// How a broadcasting op reads its inputs, without an index per element: the output as `rows`
/// rows of `length` elements, adjacent axes merged wherever every input allows it (equal shapes
/// make one row, a bias vector one row per vector), and for each input the offset where each
/// row starts and its step along a row, 1 or 0 (one element repeated).
struct BroadcastPlan {
    let count: Int
    let length: Int
    let rows: Int
    /// steps[i]: input i's step along a row.
    let steps: [Int]
    /// offsets[r * inputs + i]: where input i's elements for output row r start.
    let offsets: [Int]

    init(output: [Int], inputs: [[Int]]) {
        let rank = output.count
        count = elementCount(output)
        // Inputs of the output's size or of one element (most ops): one row.
        if count > 0, inputs.allSatisfy({ $0 == output || elementCount($0) == 1 }) {
            length = count
            rows = 1
            steps = inputs.map { $0 == output ? 1 : 0 }
            offsets = [Int](repeating: 0, count: inputs.count)
            return
        }
        // Each input's stride per output axis; 0 where it broadcasts.
        let strides: [[Int]] = inputs.map { shape in
            let padded = [Int](repeating: 1, count: rank - shape.count) + shape
            let rowMajor = rowMajorStrides(padded)
            return (0..<rank).map { padded[$0] == 1 ? 0 : rowMajor[$0] }
        }
        // Groups of axes, innermost first: an axis joins the group inside it when stepping it
        // moves every input by the whole group (contiguous, or broadcast in both).
        var sizes: [Int] = []
        var groupStrides: [[Int]] = []  // [group][input]
        for axis in stride(from: rank - 1, through: 0, by: -1) where output[axis] != 1 {
            let axisStrides = strides.map { $0[axis] }
            if let last = sizes.indices.last,
               axisStrides.indices.allSatisfy({ axisStrides[$0] == groupStrides[last][$0] * sizes[last] }) {
                sizes[last] *= output[axis]
                continue
            }
            sizes.append(output[axis])
            groupStrides.append(axisStrides)
        }
        length = sizes.first ?? 1
        rows = count == 0 ? 0 : count / length
        steps = groupStrides.first ?? [Int](repeating: 0, count: inputs.count)
        var offsets = [Int](repeating: 0, count: rows * inputs.count)
        var current = [Int](repeating: 0, count: inputs.count)
        var counters = [Int](repeating: 0, count: sizes.count)
        for row in 0..<rows {
            for input in inputs.indices { offsets[row * inputs.count + input] = current[input] }
            var group = 1
            while group < sizes.count {
                counters[group] += 1
                for input in inputs.indices { current[input] += groupStrides[group][input] }
                if counters[group] < sizes[group] { break }
                for input in inputs.indices { current[input] -= groupStrides[group][input] * sizes[group] }
                counters[group] = 0
                group += 1
            }
        }
        self.offsets = offsets
    }
}

/// Offsets `base + sum(index[d] * strides[d])` over every index of `shape`, in row-major order
/// (walked by forEachOffset).
func strideIndices(shape: [Int], strides: [Int], base: Int) -> [Int] {
    var result = [Int](repeating: 0, count: elementCount(shape))
    result.withUnsafeMutableBufferPointer { out in
        forEachOffset(shape: shape, strides: strides) { index, offset in out[index] = base + offset }
    }
    return result
}

/// The offsets `base + sum(index[d] * strides[d])` over every index of `shape`, in row-major
/// order (what `strideIndices` lists), as runs: axes merged where one continues the other, then
/// `rowStarts.count` runs of `length` elements `step` apart. Slices, transposes, splits and
/// broadcasts copy through it without an index per element.
struct StridedWalk {
    let count: Int
    let length: Int
    let step: Int
    let rowStarts: [Int]

    init(shape: [Int], strides: [Int], base: Int) {
        count = elementCount(shape)
        var sizes: [Int] = []  // innermost first
        var steps: [Int] = []
        for axis in stride(from: shape.count - 1, through: 0, by: -1) where shape[axis] != 1 {
            if let last = sizes.indices.last, strides[axis] == steps[last] * sizes[last] {
                sizes[last] *= shape[axis]
            } else {
                sizes.append(shape[axis])
                steps.append(strides[axis])
            }
        }
        length = sizes.first ?? 1
        step = steps.first ?? 1
        let rows = count == 0 ? 0 : count / length
        var starts = [Int](repeating: base, count: rows)
        var offset = base
        var counters = [Int](repeating: 0, count: sizes.count)
        for row in 0..<rows {
            starts[row] = offset
            var group = 1
            while group < sizes.count {
                counters[group] += 1
                offset += steps[group]
                if counters[group] < sizes[group] { break }
                offset -= steps[group] * sizes[group]
                counters[group] = 0
                group += 1
            }
        }
        rowStarts = starts
    }

    /// `transform` of the walked elements of `source`, in order.
    @inline(__always)
    func gather<T, R>(_ elements: UnsafeBufferPointer<T>, _ transform: (T) -> R) -> [R] {
        guard count > 0, let source = elements.baseAddress else { return [] }
        return [R](unsafeUninitializedCapacity: count) { buffer, initialized in
            var out = buffer.baseAddress!
            for start in rowStarts {
                let run = source + start
                if step == 1 {
                    for t in 0..<length { (out + t).initialize(to: transform(run[t])) }
                } else {
                    for t in 0..<length { (out + t).initialize(to: transform(run[t &* step])) }
                }
                out += length
            }
            initialized = count
        }
    }

    /// Writes `transform` of `values` (`count` of them, in order) to the walked elements of
    /// `destination`.
    @inline(__always)
    func scatter<T, S>(_ elements: UnsafeBufferPointer<S>, into target: UnsafeMutableBufferPointer<T>, _ transform: (S) -> T) {
        guard count > 0, let values = elements.baseAddress, let destination = target.baseAddress else { return }
        var from = values
        for start in rowStarts {
            let run = destination + start
            // Wrapping index arithmetic (bounded by the buffers' sizes): an overflow check
            // would keep the copy from being vectorized.
            if step == 1 {
                for t in 0..<length { run[t] = transform(from[t]) }
            } else {
                for t in 0..<length { run[t &* step] = transform(from[t]) }
            }
            from += length
        }
    }
}

extension TensorData {
    /// The elements a walk visits, in order, with the same storage kind (fp16 weights are
    /// widened to fp32 values), as `picking(strideIndices(...))` gives.
    func gathering(_ walk: StridedWalk) -> TensorData {
        switch self {
        case .float(let values):
            return values.withUnsafeBufferPointer { source in .float(walk.gather(source) { $0 }) }
        case .half(let storage):
            return .float(walk.gather(storage.values) { Half.toFloat($0) })
        case .int(let values):
            return values.withUnsafeBufferPointer { source in .int(walk.gather(source) { $0 }) }
        case .bool(let values):
            return values.withUnsafeBufferPointer { source in .bool(walk.gather(source) { $0 }) }
        case .string(let values):
            return values.withUnsafeBufferPointer { source in .string(walk.gather(source) { $0 }) }
        }
    }
}

extension TensorData {
    /// The elements at `indices`, in that order, with the same storage kind (fp16 weights are
    /// widened to fp32 values, which are still fp16-representable).
    func picking(_ indices: [Int]) -> TensorData {
        switch self {
        case .float(let values):
            return values.withUnsafeBufferPointer { source in .float(indices.map { source[$0] }) }
        case .half(let storage):
            let source = storage.values
            return .float(indices.map { Half.toFloat(source[$0]) })
        case .int(let values):
            return values.withUnsafeBufferPointer { source in .int(indices.map { source[$0] }) }
        case .bool(let values):
            return .bool(indices.map { values[$0] })
        case .string(let values):
            return .string(indices.map { values[$0] })
        }
    }
}

extension Tensor {
    func picking(_ indices: [Int], shape: [Int]) -> Tensor {
        Tensor(shape: shape, type: type, data: data.picking(indices))
    }

    /// The elements at `base + sum(index[d] * strides[d])` for every index of `shape`.
    func strided(_ shape: [Int], strides: [Int], base: Int) -> Tensor {
        Tensor(shape: shape, type: type, data: data.gathering(StridedWalk(shape: shape, strides: strides, base: base)))
    }

    func reshaped(_ shape: [Int]) -> Tensor {
        Tensor(shape: shape, type: type, data: data)
    }
}

/// Python's `slice(start, stop, step).indices(size)`: the first index, the step and the count.
func sliceIndices(start: Int?, stop: Int?, step: Int, size: Int) throws -> (first: Int, count: Int) {
    guard step != 0 else { throw KernelError("slice stride 0") }
    var first: Int
    var end: Int
    if step > 0 {
        first = start.map { $0 < 0 ? max($0 + size, 0) : min($0, size) } ?? 0
        end = stop.map { $0 < 0 ? max($0 + size, 0) : min($0, size) } ?? size
        let count = end > first ? (end - first + step - 1) / step : 0
        return (first, count)
    }
    first = start.map { $0 < 0 ? max($0 + size, -1) : min($0, size - 1) } ?? size - 1
    end = stop.map { $0 < 0 ? max($0 + size, -1) : min($0, size - 1) } ?? -1
    let count = first > end ? (first - end - step - 1) / (-step) : 0
    return (first, count)
}

/// Calls `body(row-major index, element offset by strides)` for every element of an array of
/// `shape` laid out with `strides`: how the Core ML backend and its stand-in walk an
/// `MLMultiArray` whose rows may be padded (every output of every call, logits included). Row
/// by row: along the last axis the offset moves by its stride, and each new row's offset is
/// carried from the last like an odometer, with no division per element.
public func forEachOffset(shape: [Int], strides: [Int], _ body: (Int, Int) -> Void) {
    let count = shape.reduce(1, *)
    guard count > 0 else { return }
    guard let last = shape.indices.last else { return body(0, 0) }
    var coordinates = [Int](repeating: 0, count: shape.count)
    var rowOffset = 0, index = 0
    while index < count {
        var offset = rowOffset
        for _ in 0..<shape[last] {
            body(index, offset)
            index += 1
            offset += strides[last]
        }
        var axis = last - 1
        while axis >= 0 {
            coordinates[axis] += 1
            rowOffset += strides[axis]
            if coordinates[axis] < shape[axis] { break }
            rowOffset -= shape[axis] * strides[axis]
            coordinates[axis] = 0
            axis -= 1
        }
    }
}
