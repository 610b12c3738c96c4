import Foundation

/// A tensor viewed as [outer, axis, inner] around one axis.
struct AxisView {
    let outer: Int, size: Int, inner: Int
    init(shape: [Int], axis: Int) {
        outer = elementCount(Array(shape[..<axis]))
        size = shape[axis]
        inner = elementCount(Array(shape[(axis + 1)...]))
    }
}

/// Reduces `values` of `shape` over one axis with `body(values along the axis) -> value`.
func reduceAxis<T, R>(_ values: [T], shape: [Int], axis: Int, _ body: ([T]) -> R) -> [R] {
    let view = AxisView(shape: shape, axis: axis)
    var result: [R] = []
    result.reserveCapacity(view.outer * view.inner)
    var lane = [T]()
    lane.reserveCapacity(view.size)
    if view.inner == 1 {
        // The axis is the last: each lane is a contiguous run, copied whole.
        for o in 0..<view.outer {
            lane.removeAll(keepingCapacity: true)
            lane.append(contentsOf: values[(o * view.size)..<((o + 1) * view.size)])
            result.append(body(lane))
        }
        return result
    }
    for o in 0..<view.outer {
        for i in 0..<view.inner {
            lane.removeAll(keepingCapacity: true)
            for a in 0..<view.size { lane.append(values[(o * view.size + a) * view.inner + i]) }
            result.append(body(lane))
        }
    }
    return result
}

func reduction(float: @escaping ([Float]) -> Float, int: (([Int32]) -> Int32)? = nil,
               finish: ((Float, Int) -> Float)? = nil, sums: Bool = false) -> Kernel {
    { args in
        let x = try args.tensor("x")
        let keep = try args.bool("keep_dims")
        let axes = try (args.optionalInts("axes") ?? Array(0..<x.rank)).map { try normalizedAxis($0, rank: x.rank) }
        var shape = x.shape
        var reducedCount = 1
        let useInts = x.type.isInteger && int != nil
        var floats = useInts ? [] : x.floats()
        var ints = useInts ? x.ints() : []
        // One axis at a time, last first, each kept as size 1 until the end.
        for axis in Set(axes).sorted(by: >) {
            reducedCount *= shape[axis]
            if useInts, let int = int { ints = reduceAxis(ints, shape: shape, axis: axis, int) }
            else if sums { floats = sumAxis(floats, shape: shape, axis: axis) }
            else { floats = reduceAxis(floats, shape: shape, axis: axis, float) }
            shape[axis] = 1
        }
        if let finish = finish { floats = floats.map { finish($0, reducedCount) } }
        let outShape = keep ? shape : shape.enumerated().filter { !axes.map { $0 }.contains($0.offset) }.map(\.element)
        if useInts { return [.ints(ints, shape: outShape)] }
        return [.floats(floats, shape: outShape)]
    }
}

func sumDouble(_ values: [Float]) -> Float {
    Float(values.reduce(0.0) { $0 + Double($1) })
}

func argReduction(larger: Bool) -> Kernel {
    { args in
        let x = try args.tensor("x")
        let axis = try normalizedAxis(args.int("axis", default: -1), rank: x.rank)
        let values = x.floats()
        let indices = reduceAxis(values, shape: x.shape, axis: axis) { lane -> Int32 in
            var best = 0
            for index in 1..<max(lane.count, 1) {
                if lane[best].isNaN { break }
                if lane[index].isNaN || (larger ? lane[index] > lane[best] : lane[index] < lane[best]) { best = index }
            }
            return Int32(best)
        }
        var shape = x.shape
        if try args.bool("keep_dims") { shape[axis] = 1 } else { shape.remove(at: axis) }
        return [.ints(indices, shape: shape)]
    }
}

/// `viaDouble(exp, d)` for softmax's d = x - max(x) <= 0: 0 below -110 (e^-110 is far under
/// half fp32's smallest subnormal, so it rounds to 0 whatever exp's last bit; glibc's exp takes
/// a slow path there), the table's entry when d is an fp16, else computed.
@inline(__always)
func softmaxExp(_ d: Float, _ table: UnsafePointer<Float>?) -> Float {
    if d < -110 { return 0 }
    if let table = table { return expTable.lookUp(d, in: table) }
    return viaDouble(Foundation.exp, d)
}

/// Softmax of `count` contiguous values in place, as the general loop computes it: the peak
/// found eight lanes at a time (the same value as the running `Swift.max`, NaNs skipped alike;
/// only the sign of a zero peak may differ, which no `v - peak` or its exp can tell), the
/// exponentials and their float64 sum in order, then a division that vectorizes.
@inline(__always)
func softmaxRow(_ row: UnsafeMutablePointer<Float>, count: Int, _ table: UnsafePointer<Float>?) {
    var lanes = SIMD8<Float>(repeating: -.infinity)
    var a = 0
    while a &+ 8 <= count {
        let x = UnsafeRawPointer(row + a).loadUnaligned(as: SIMD8<Float>.self)
        lanes.replace(with: x, where: x .> lanes)
        a &+= 8
    }
    var peak = -Float.infinity
    for lane in 0..<8 { peak = Swift.max(peak, lanes[lane]) }
    while a < count {
        peak = Swift.max(peak, row[a])
        a &+= 1
    }
    var total = 0.0
    for a in 0..<count {
        let e = softmaxExp(row[a] - peak, table)
        row[a] = e
        total += Double(e)
    }
    let sum = Float(total)
    for a in 0..<count { row[a] /= sum }
}

/// Sums along one axis in float64, each in order from 0, rounded once to fp32: `sumDouble`
/// of every lane without building the lanes.
func sumAxis(_ values: [Float], shape: [Int], axis: Int) -> [Float] {
    let view = AxisView(shape: shape, axis: axis)
    var result = [Float](repeating: 0, count: view.outer * view.inner)
    values.withUnsafeBufferPointer { v in
        result.withUnsafeMutableBufferPointer { out in
            for o in 0..<view.outer {
                for i in 0..<view.inner {
                    var total = 0.0
                    var index = o * view.size * view.inner + i
                    for _ in 0..<view.size {
                        total += Double(v[index])
                        index += view.inner
                    }
                    out[o * view.inner + i] = Float(total)
                }
            }
        }
    }
    return result
}

let reductionKernels: [String: Kernel] = [
    "reduce_sum": reduction(float: sumDouble, int: { $0.reduce(0, &+) }, sums: true),
    "reduce_mean": reduction(float: sumDouble, finish: { $0 / Float($1) }, sums: true),
    "reduce_max": reduction(float: { $0.max() ?? -.infinity }, int: { $0.max() ?? Int32.min }),
    "reduce_min": reduction(float: { $0.min() ?? .infinity }, int: { $0.min() ?? Int32.max }),
    "reduce_prod": reduction(float: { $0.reduce(1, *) }, int: { $0.reduce(1, &*) }),
    "reduce_sum_square": reduction(float: { Float($0.reduce(0.0) { $0 + Double($1) * Double($1) }) }),
    "reduce_l1_norm": reduction(float: { Float($0.reduce(0.0) { $0 + Double(Swift.abs($1)) }) }),
    "reduce_l2_norm": reduction(float: { Float($0.reduce(0.0) { $0 + Double($1) * Double($1) }.squareRoot()) }),
    "reduce_log_sum_exp": reduction(float: { lane in
        let peak = lane.max() ?? 0
        let total = Float(lane.reduce(0.0) { $0 + Double(viaDouble(Foundation.exp, $1 - peak)) })
        return viaDouble(Foundation.log, total) + peak
    }),
    "reduce_argmax": argReduction(larger: true),
    "reduce_argmin": argReduction(larger: false),
    "softmax": { args in
        let x = try args.tensor("x")
        let axis = try normalizedAxis(args.int("axis", default: -1), rank: x.rank)
        let view = AxisView(shape: x.shape, axis: axis)
        var values = x.floats()
        // Differences from the peak are mostly fp16 values themselves: exp from its table.
        let table = x.count >= 1024 ? expTable.table : nil
        values.withUnsafeMutableBufferPointer { v in
            if view.inner == 1, view.size > 0 {
                // The softmax axis is the last (attention's rows): contiguous lanes.
                for o in 0..<view.outer {
                    softmaxRow(v.baseAddress! + o &* view.size, count: view.size, table)
                }
                return
            }
            for o in 0..<view.outer {
                for i in 0..<view.inner {
                    let base = o * view.size * view.inner + i
                    var peak = -Float.infinity
                    for a in 0..<view.size { peak = Swift.max(peak, v[base + a * view.inner]) }
                    var total = 0.0
                    for a in 0..<view.size {
                        let e = softmaxExp(v[base + a * view.inner] - peak, table)
                        v[base + a * view.inner] = e
                        total += Double(e)
                    }
                    let sum = Float(total)
                    for a in 0..<view.size { v[base + a * view.inner] /= sum }
                }
            }
        }
        return [.floats(values, shape: x.shape)]
    },
    "topk": { args in
        let x = try args.tensor("x")
        let k = try args.int("k")
        let axis = try normalizedAxis(args.int("axis", default: -1), rank: x.rank)
        let ascending = try args.bool("ascending")
        guard k >= 0, k <= x.shape[axis] else { throw KernelError("topk k \(k) for axis size \(x.shape[axis])") }
        let view = AxisView(shape: x.shape, axis: axis)
        let values = x.floats()
        var picked = [Int](repeating: 0, count: view.outer * k * view.inner)
        var chosen = [Int32](repeating: 0, count: picked.count)
        for o in 0..<view.outer {
            for i in 0..<view.inner {
                let base = o * view.size * view.inner + i
                // Stable: equal values keep the lower index first.
                let order = (0..<view.size).sorted { a, b in
                    let va = values[base + a * view.inner], vb = values[base + b * view.inner]
                    if va != vb { return ascending ? va < vb : va > vb }
                    return a < b
                }
                for r in 0..<k {
                    let out = (o * k + r) * view.inner + i
                    picked[out] = base + order[r] * view.inner
                    chosen[out] = Int32(order[r])
                }
            }
        }
        var shape = x.shape
        shape[axis] = k
        return [x.picking(picked, shape: shape), .ints(chosen, shape: shape)]
    },
]
