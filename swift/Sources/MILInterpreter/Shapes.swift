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

/// Offsets `base + sum(index[d] * strides[d])` over every index of `shape`, in row-major order.
func strideIndices(shape: [Int], strides: [Int], base: Int) -> [Int] {
    let count = elementCount(shape)
    var result = [Int](repeating: 0, count: count)
    if count == 0 { return result }
    let rank = shape.count
    if rank == 0 {
        result[0] = base
        return result
    }
    var counter = [Int](repeating: 0, count: rank)
    var offset = base
    let last = rank - 1
    let innerSize = shape[last]
    let innerStride = strides[last]
    var position = 0
    result.withUnsafeMutableBufferPointer { out in
        while position < count {
            var inner = offset
            for _ in 0..<innerSize {
                out[position] = inner
                position += 1
                inner += innerStride
            }
            // Advance the outer counters.
            var axis = last - 1
            while axis >= 0 {
                counter[axis] += 1
                offset += strides[axis]
                if counter[axis] < shape[axis] { break }
                offset -= strides[axis] * shape[axis]
                counter[axis] = 0
                axis -= 1
            }
            if axis < 0 { break }
        }
    }
    return result
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
