/// linear and matmul: every output element is one dot product of two contiguous rows.

/// A dot product summed in float64 and rounded once to fp32, as the numpy reference computes
/// it: the result does not depend on the summation order (float64's error is far below fp32's
/// rounding step), so the two interpreters agree bit for bit. The operands are widened to
/// float64 once per call (see `rowDots`), so the loop is only multiplies and adds.
@inline(__always)
func dot(_ a: UnsafePointer<Double>, _ b: UnsafePointer<Double>, _ count: Int) -> Float {
    var s0 = 0.0, s1 = 0.0, s2 = 0.0, s3 = 0.0
    var index = 0
    while index + 4 <= count {
        s0 += a[index] * b[index]
        s1 += a[index + 1] * b[index + 1]
        s2 += a[index + 2] * b[index + 2]
        s3 += a[index + 3] * b[index + 3]
        index += 4
    }
    while index < count {
        s0 += a[index] * b[index]
        index += 1
    }
    return Float((s0 + s1) + (s2 + s3))
}

/// out[m, n] = dot(x[m, :], w[n, :]) (+ bias[n]) for x [M, K] and w [N, K]: x widened to
/// float64 once, each weight row (fp16 or fp32) widened once into a scratch row and dotted
/// with every row of x.
func rowDots(x: [Float], rows: Int, depth: Int, weight: TensorData, outputs: Int, bias: [Float]?) -> [Float] {
    var out = [Float](repeating: 0, count: rows * outputs)
    let wide = x.map(Double.init)
    var scratch = [Double](repeating: 0, count: depth)
    let floatWeights: [Float]
    if case .float(let values) = weight { floatWeights = values } else { floatWeights = [] }
    wide.withUnsafeBufferPointer { xs in
        out.withUnsafeMutableBufferPointer { result in
            scratch.withUnsafeMutableBufferPointer { row in
                floatWeights.withUnsafeBufferPointer { fw in
                    for n in 0..<outputs {
                        if case .half(let storage) = weight {
                            let source = storage.values.baseAddress! + n * depth
                            for k in 0..<depth { row[k] = Double(Half.widen(source[k])) }
                        } else {
                            let source = fw.baseAddress! + n * depth
                            for k in 0..<depth { row[k] = Double(source[k]) }
                        }
                        let offset = bias?[n] ?? 0
                        for m in 0..<rows {
                            result[m * outputs + n] = dot(xs.baseAddress! + m * depth, UnsafePointer(row.baseAddress!), depth) + offset
                        }
                    }
                }
            }
        }
    }
    return out
}

/// The last two axes swapped, copied contiguous.
func swapLastAxes(_ tensor: Tensor) -> Tensor {
    var perm = Array(0..<tensor.rank)
    perm.swapAt(tensor.rank - 1, tensor.rank - 2)
    return transposed(tensor, perm: perm)
}

func transposed(_ tensor: Tensor, perm: [Int]) -> Tensor {
    let strides = rowMajorStrides(tensor.shape)
    let shape = perm.map { tensor.shape[$0] }
    let indices = strideIndices(shape: shape, strides: perm.map { strides[$0] }, base: 0)
    return tensor.picking(indices, shape: shape)
}

let linearAlgebraKernels: [String: Kernel] = [
    "linear": { args in
        let x = try args.tensor("x"), weight = try args.tensor("weight")
        guard weight.rank == 2, let depth = x.shape.last, depth == weight.shape[1] else {
            throw KernelError("linear of \(x) with weight \(weight)")
        }
        let outputs = weight.shape[0]
        let bias = try args.optional("bias")?.floats()
        if let bias = bias, bias.count != outputs { throw KernelError("bias of \(bias.count) for \(outputs) outputs") }
        let weightData: TensorData
        if case .half = weight.data { weightData = weight.data } else { weightData = .float(weight.floats()) }
        let rows = x.count / max(depth, 1)
        let out = rowDots(x: x.floats(), rows: rows, depth: depth, weight: weightData, outputs: outputs, bias: bias)
        return [.floats(out, shape: Array(x.shape.dropLast()) + [outputs])]
    },
    "matmul": { args in
        var x = try args.tensor("x"), y = try args.tensor("y")
        guard x.rank >= 2, y.rank >= 2 else { throw KernelError("matmul of rank < 2 (\(x), \(y)) is not supported") }
        if try args.bool("transpose_x") { x = swapLastAxes(x) }
        // Rows of y^T are contiguous columns of y.
        let yT = try args.bool("transpose_y") ? y : swapLastAxes(y)
        let m = x.shape[x.rank - 2], k = x.shape[x.rank - 1]
        let n = yT.shape[yT.rank - 2]
        guard yT.shape[yT.rank - 1] == k else { throw KernelError("matmul inner sizes differ: \(x) and \(y)") }
        let xBatch = Array(x.shape.dropLast(2)), yBatch = Array(yT.shape.dropLast(2))
        let batch = try broadcastShape([xBatch, yBatch])
        let batches = elementCount(batch)
        let xIndex = broadcastIndices(from: xBatch, to: batch), yIndex = broadcastIndices(from: yBatch, to: batch)
        let xs = x.floats().map(Double.init), ys = yT.floats().map(Double.init)
        var out = [Float](repeating: 0, count: batches * m * n)
        xs.withUnsafeBufferPointer { xp in
            ys.withUnsafeBufferPointer { yp in
                out.withUnsafeMutableBufferPointer { op in
                    for b in 0..<batches {
                        let xBase = xp.baseAddress! + (xIndex?[b] ?? b) * m * k
                        let yBase = yp.baseAddress! + (yIndex?[b] ?? b) * n * k
                        for i in 0..<m {
                            for j in 0..<n {
                                op[(b * m + i) * n + j] = dot(xBase + i * k, yBase + j * k, k)
                            }
                        }
                    }
                }
            }
        }
        return [.floats(out, shape: batch + [m, n])]
    },
]
