/// linear and matmul: every output element is one dot product of two contiguous rows.

import Foundation

/// Four float64 partial sums: lane j of a `Chains` adds up the products at k = j, j + 4, j + 8,
/// ... in increasing k. A dot product is `(s0 + s1) + (s2 + s3)` of its four lanes, rounded
/// once to fp32, the same order whatever the tile size or instruction set: the sums are those
/// of the plain four-chain loop, bit for bit.
typealias Chains = SIMD4<Double>

@inline(__always)
func loadChains(_ pointer: UnsafePointer<Double>) -> Chains {
    UnsafeRawPointer(pointer).loadUnaligned(as: Chains.self)
}

/// `sums + a * b`. Both operands are fp32 values (widened to float64), so their product has at
/// most 48 significant bits and no exponent outside float64's range: it is exact, and a fused
/// multiply-add rounds once where mul-then-add rounds the same sum once. The two are the same
/// bits; the fused one is half the instructions where the CPU has it (AArch64 always, x86
/// built for Haswell or later).
@inline(__always)
func multiplyAdd(_ sums: inout Chains, _ a: Chains, _ b: Chains) {
    #if arch(arm64) || MILINTERPRETER_HASWELL
    sums.addProduct(a, b)
    #else
    sums += a * b
    #endif
}

@inline(__always)
func total(_ sums: Chains) -> Float { Float((sums[0] + sums[1]) + (sums[2] + sums[3])) }

/// out[i * ldo + j] = dot(a row i, b row j) (+ bias[j]) for the `rows` x `cols` tile at `a`,
/// `b` (rows of `depth` float64 values, `lda` and `ldb` apart). `rows` <= 4 and `cols` <= 3
/// are literals at every call, so the unused accumulators fold away: up to 12 dot products
/// share each load of their rows.
@inline(__always)
func tile(rows: Int, cols: Int, _ a: UnsafePointer<Double>, _ lda: Int, _ b: UnsafePointer<Double>, _ ldb: Int,
          depth: Int, _ out: UnsafeMutablePointer<Float>, _ ldo: Int, bias: UnsafePointer<Float>?) {
    var c00 = Chains.zero, c01 = Chains.zero, c02 = Chains.zero
    var c10 = Chains.zero, c11 = Chains.zero, c12 = Chains.zero
    var c20 = Chains.zero, c21 = Chains.zero, c22 = Chains.zero
    var c30 = Chains.zero, c31 = Chains.zero, c32 = Chains.zero
    // Wrapping arithmetic (&+, &*) on counters and offsets: every one is bounded by the buffers'
    // sizes, and overflow checks would keep the loop from being unrolled as -Ounchecked did.
    let a1 = a + lda, a2 = a + 2 &* lda, a3 = a + 3 &* lda
    let b1 = b + ldb, b2 = b + 2 &* ldb
    var k = 0
    while k &+ 4 <= depth {
        let w0 = loadChains(b + k)
        let w1 = cols > 1 ? loadChains(b1 + k) : .zero
        let w2 = cols > 2 ? loadChains(b2 + k) : .zero
        let x0 = loadChains(a + k)
        multiplyAdd(&c00, x0, w0)
        if cols > 1 { multiplyAdd(&c01, x0, w1) }
        if cols > 2 { multiplyAdd(&c02, x0, w2) }
        if rows > 1 {
            let x1 = loadChains(a1 + k)
            multiplyAdd(&c10, x1, w0)
            if cols > 1 { multiplyAdd(&c11, x1, w1) }
            if cols > 2 { multiplyAdd(&c12, x1, w2) }
        }
        if rows > 2 {
            let x2 = loadChains(a2 + k)
            multiplyAdd(&c20, x2, w0)
            if cols > 1 { multiplyAdd(&c21, x2, w1) }
            if cols > 2 { multiplyAdd(&c22, x2, w2) }
        }
        if rows > 3 {
            let x3 = loadChains(a3 + k)
            multiplyAdd(&c30, x3, w0)
            if cols > 1 { multiplyAdd(&c31, x3, w1) }
            if cols > 2 { multiplyAdd(&c32, x3, w2) }
        }
        k &+= 4
    }
    // A depth that is not a multiple of 4: the last products go to the first chain, in order.
    while k < depth {
        c00[0] += a[k] * b[k]
        if cols > 1 { c01[0] += a[k] * b1[k] }
        if cols > 2 { c02[0] += a[k] * b2[k] }
        if rows > 1 {
            c10[0] += a1[k] * b[k]
            if cols > 1 { c11[0] += a1[k] * b1[k] }
            if cols > 2 { c12[0] += a1[k] * b2[k] }
        }
        if rows > 2 {
            c20[0] += a2[k] * b[k]
            if cols > 1 { c21[0] += a2[k] * b1[k] }
            if cols > 2 { c22[0] += a2[k] * b2[k] }
        }
        if rows > 3 {
            c30[0] += a3[k] * b[k]
            if cols > 1 { c31[0] += a3[k] * b1[k] }
            if cols > 2 { c32[0] += a3[k] * b2[k] }
        }
        k &+= 1
    }
    let o0 = bias?[0] ?? 0, o1 = cols > 1 ? bias?[1] ?? 0 : 0, o2 = cols > 2 ? bias?[2] ?? 0 : 0
    out[0] = total(c00) + o0
    if cols > 1 { out[1] = total(c01) + o1 }
    if cols > 2 { out[2] = total(c02) + o2 }
    if rows > 1 {
        let row = out + ldo
        row[0] = total(c10) + o0
        if cols > 1 { row[1] = total(c11) + o1 }
        if cols > 2 { row[2] = total(c12) + o2 }
    }
    if rows > 2 {
        let row = out + 2 &* ldo
        row[0] = total(c20) + o0
        if cols > 1 { row[1] = total(c21) + o1 }
        if cols > 2 { row[2] = total(c22) + o2 }
    }
    if rows > 3 {
        let row = out + 3 &* ldo
        row[0] = total(c30) + o0
        if cols > 1 { row[1] = total(c31) + o1 }
        if cols > 2 { row[2] = total(c32) + o2 }
    }
}

/// One weight row as `eightRowTile` reads it: fp16 values (as mapped from a weight file) or
/// fp32 values, each group of four widened to float64 as it is loaded (the same float64
/// values a widened copy holds, so the same sums).
protocol WeightRow {
    /// Values k ..< k + 4.
    func chains(_ k: Int) -> Chains
    /// Value k.
    func element(_ k: Int) -> Double
}

struct HalfRow: WeightRow {
    let base: UnsafePointer<UInt16>

    @inline(__always)
    func chains(_ k: Int) -> Chains {
        let source = base + k
        #if MILINTERPRETER_HASWELL
        // F16C's conversion, as `widen` does.
        let bits = UnsafeRawPointer(source).loadUnaligned(as: SIMD4<UInt16>.self)
        return Chains(Double(Float(Float16(bitPattern: bits[0]))), Double(Float(Float16(bitPattern: bits[1]))),
                      Double(Float(Float16(bitPattern: bits[2]))), Double(Float(Float16(bitPattern: bits[3]))))
        #else
        return Chains(Double(Half.widen(source[0])), Double(Half.widen(source[1])),
                      Double(Half.widen(source[2])), Double(Half.widen(source[3])))
        #endif
    }

    @inline(__always)
    func element(_ k: Int) -> Double {
        var value = 0.0
        widen(base + k, toDoubles: &value, count: 1)
        return value
    }
}

struct FloatRow: WeightRow {
    let base: UnsafePointer<Float>

    @inline(__always)
    func chains(_ k: Int) -> Chains {
        let source = base + k
        return Chains(Double(source[0]), Double(source[1]), Double(source[2]), Double(source[3]))
    }

    @inline(__always)
    func element(_ k: Int) -> Double { Double(base[k]) }
}

/// Rows 8g ..< 8g + 8 of `wide` (`depth` float64 values each) interleaved by fours: for each
/// k = 0, 4, 8, ... below depth rounded down to 4, the eight rows' values k ..< k + 4 in row
/// order, so that `eightRowTile` reads all eight from one pointer at fixed offsets.
func interleaveEights(_ wide: UnsafePointer<Double>, groups: Int, depth: Int, into packed: UnsafeMutablePointer<Double>) {
    let quads = depth / 4
    for g in 0..<groups {
        let block = packed + g &* 32 &* quads
        for r in 0..<8 {
            let row = wide + (g &* 8 &+ r) &* depth
            for q in 0..<quads {
                UnsafeMutableRawPointer(block + (q &* 32 &+ r &* 4)).storeBytes(of: loadChains(row + q &* 4), as: Chains.self)
            }
        }
    }
}

/// out[i * ldo] = dot(x row i, w) + offset for eight rows of x and one weight row: x's rows
/// interleaved by `interleaveEights` at `packed` (the remainder of a depth that is not a
/// multiple of 4 read from the rows themselves, `lda` apart, at `rows`), w widened as it is
/// read. Eight dot products share each load of the weights, which are read once, in order;
/// all x loads come from one pointer at fixed offsets, so the loop is little more than its
/// multiply-adds.
@inline(__always)
func eightRowTile<W: WeightRow>(_ packed: UnsafePointer<Double>, _ rows: UnsafePointer<Double>, _ lda: Int, _ w: W,
                                depth: Int, _ out: UnsafeMutablePointer<Float>, _ ldo: Int, offset: Float) {
    var c0 = Chains.zero, c1 = Chains.zero, c2 = Chains.zero, c3 = Chains.zero
    var c4 = Chains.zero, c5 = Chains.zero, c6 = Chains.zero, c7 = Chains.zero
    var p = packed
    var k = 0
    while k &+ 4 <= depth {
        let v = w.chains(k)
        multiplyAdd(&c0, loadChains(p), v)
        multiplyAdd(&c1, loadChains(p + 4), v)
        multiplyAdd(&c2, loadChains(p + 8), v)
        multiplyAdd(&c3, loadChains(p + 12), v)
        multiplyAdd(&c4, loadChains(p + 16), v)
        multiplyAdd(&c5, loadChains(p + 20), v)
        multiplyAdd(&c6, loadChains(p + 24), v)
        multiplyAdd(&c7, loadChains(p + 28), v)
        p += 32
        k &+= 4
    }
    // A depth that is not a multiple of 4: the last products go to the first chain, in order.
    while k < depth {
        let v = w.element(k)
        c0[0] += rows[k] * v
        c1[0] += rows[lda &+ k] * v
        c2[0] += rows[2 &* lda &+ k] * v
        c3[0] += rows[3 &* lda &+ k] * v
        c4[0] += rows[4 &* lda &+ k] * v
        c5[0] += rows[5 &* lda &+ k] * v
        c6[0] += rows[6 &* lda &+ k] * v
        c7[0] += rows[7 &* lda &+ k] * v
        k &+= 1
    }
    out[0] = total(c0) + offset
    out[ldo] = total(c1) + offset
    out[2 &* ldo] = total(c2) + offset
    out[3 &* ldo] = total(c3) + offset
    out[4 &* ldo] = total(c4) + offset
    out[5 &* ldo] = total(c5) + offset
    out[6 &* ldo] = total(c6) + offset
    out[7 &* ldo] = total(c7) + offset
}

/// Every row of `a` (`rows` x `depth`) against `cols` rows of `b` (`cols` <= 3), in tiles of 4.
@inline(__always)
func rowsAgainst(cols: Int, _ a: UnsafePointer<Double>, rows: Int, _ b: UnsafePointer<Double>, depth: Int,
                 _ out: UnsafeMutablePointer<Float>, _ ldo: Int, bias: UnsafePointer<Float>?) {
    var m = 0
    while m &+ 4 <= rows {
        tile(rows: 4, cols: cols, a + m &* depth, depth, b, depth, depth: depth, out + m &* ldo, ldo, bias: bias)
        m &+= 4
    }
    while m < rows {
        tile(rows: 1, cols: cols, a + m &* depth, depth, b, depth, depth: depth, out + m &* ldo, ldo, bias: bias)
        m &+= 1
    }
}

/// out[i, j] = dot(a[i, :], b[j, :]) for a [rows, depth] and b [cols, depth], float64 rows;
/// `out` has `ldo` floats per row.
func rowProducts(_ a: UnsafePointer<Double>, rows: Int, _ b: UnsafePointer<Double>, cols: Int, depth: Int,
                 _ out: UnsafeMutablePointer<Float>, _ ldo: Int) {
    var n = 0
    while n &+ 3 <= cols {
        rowsAgainst(cols: 3, a, rows: rows, b + n &* depth, depth: depth, out + n, ldo, bias: nil)
        n &+= 3
    }
    while n < cols {
        rowsAgainst(cols: 1, a, rows: rows, b + n &* depth, depth: depth, out + n, ldo, bias: nil)
        n &+= 1
    }
}

/// out[0, 4v ..< 4v + 4] for v < `vectors` (<= 3, a literal at every call) = the dot products
/// of one row of x with 4 * `vectors` adjacent columns of y: x's k-th element at
/// `x[k * xStep]`, y's row k at `y + k * ldy` (columns contiguous). The columns are the lanes:
/// a `Chains` per column group and per chain, chain j taking k = j, j + 4, ... in increasing
/// k (the remainder on chain 0), added as `(s0 + s1) + (s2 + s3)` lane by lane: each lane is
/// the four-chain dot of its column, the same sums in the same order as `tile`'s, without a
/// copy of y transposed and without a sum across lanes.
@inline(__always)
func columnTile(vectors: Int, _ x: UnsafePointer<Double>, _ xStep: Int, _ y: UnsafePointer<Double>, _ ldy: Int,
                depth: Int, _ out: UnsafeMutablePointer<Float>) {
    var a0 = Chains.zero, a1 = Chains.zero, a2 = Chains.zero, a3 = Chains.zero
    var b0 = Chains.zero, b1 = Chains.zero, b2 = Chains.zero, b3 = Chains.zero
    var c0 = Chains.zero, c1 = Chains.zero, c2 = Chains.zero, c3 = Chains.zero
    @inline(__always)
    func step(_ k: Int, _ s0: inout Chains, _ s1: inout Chains, _ s2: inout Chains) {
        let xk = Chains(repeating: x[k &* xStep])
        let row = y + k &* ldy
        multiplyAdd(&s0, xk, loadChains(row))
        if vectors > 1 { multiplyAdd(&s1, xk, loadChains(row + 4)) }
        if vectors > 2 { multiplyAdd(&s2, xk, loadChains(row + 8)) }
    }
    var k = 0
    while k &+ 4 <= depth {
        step(k, &a0, &b0, &c0)
        step(k &+ 1, &a1, &b1, &c1)
        step(k &+ 2, &a2, &b2, &c2)
        step(k &+ 3, &a3, &b3, &c3)
        k &+= 4
    }
    // A depth that is not a multiple of 4: the last products go to the first chain, in order.
    while k < depth {
        step(k, &a0, &b0, &c0)
        k &+= 1
    }
    @inline(__always)
    func store(_ s0: Chains, _ s1: Chains, _ s2: Chains, _ s3: Chains, _ to: UnsafeMutablePointer<Float>) {
        let sums = (s0 + s1) + (s2 + s3)
        to[0] = Float(sums[0])
        to[1] = Float(sums[1])
        to[2] = Float(sums[2])
        to[3] = Float(sums[3])
    }
    store(a0, a1, a2, a3, out)
    if vectors > 1 { store(b0, b1, b2, b3, out + 4) }
    if vectors > 2 { store(c0, c1, c2, c3, out + 8) }
}

/// One four-chain dot of strided float64 values: x's k-th at `x[k * xStep]`, y's at
/// `y[k * yStep]`. For the columns a `columnTile` leaves over.
@inline(__always)
func stridedDot(_ x: UnsafePointer<Double>, _ xStep: Int, _ y: UnsafePointer<Double>, _ yStep: Int, depth: Int) -> Float {
    var sums = Chains.zero
    var k = 0
    while k &+ 4 <= depth {
        let a = Chains(x[k &* xStep], x[(k &+ 1) &* xStep], x[(k &+ 2) &* xStep], x[(k &+ 3) &* xStep])
        let b = Chains(y[k &* yStep], y[(k &+ 1) &* yStep], y[(k &+ 2) &* yStep], y[(k &+ 3) &* yStep])
        multiplyAdd(&sums, a, b)
        k &+= 4
    }
    while k < depth {
        sums[0] += x[k &* xStep] * y[k &* yStep]
        k &+= 1
    }
    return total(sums)
}

/// out[i, j] = dot(x row i, y column j) for `rows` rows of x (x's element (i, k) at
/// `x[i * xRow + k * xStep]`) and `cols` columns of y ([depth, cols] rows `ldy` apart):
/// twelve columns at a time, then four, then one by one. `out` has `ldo` floats per row.
func columnProducts(_ x: UnsafePointer<Double>, rows: Int, xRow: Int, xStep: Int, _ y: UnsafePointer<Double>, cols: Int,
                    ldy: Int, depth: Int, _ out: UnsafeMutablePointer<Float>, _ ldo: Int) {
    for i in 0..<rows {
        let xi = x + i &* xRow, oi = out + i &* ldo
        var j = 0
        while j &+ 12 <= cols {
            columnTile(vectors: 3, xi, xStep, y + j, ldy, depth: depth, oi + j)
            j &+= 12
        }
        while j &+ 4 <= cols {
            columnTile(vectors: 1, xi, xStep, y + j, ldy, depth: depth, oi + j)
            j &+= 4
        }
        while j < cols {
            oi[j] = stridedDot(xi, xStep, y + j, ldy, depth: depth)
            j &+= 1
        }
    }
}

/// `count` fp16 values as float64 (exact).
@inline(__always)
func widen(_ source: UnsafePointer<UInt16>, toDoubles destination: UnsafeMutablePointer<Double>, count: Int) {
    #if MILINTERPRETER_HASWELL
    // F16C's conversion instruction: the same exact values as Half.widen (a signalling NaN
    // comes out quiet, which no fp16 output can tell apart).
    var k = 0
    while k < count {
        destination[k] = Double(Float(Float16(bitPattern: source[k])))
        k &+= 1
    }
    #else
    var k = 0
    while k < count {
        destination[k] = Double(Half.widen(source[k]))
        k &+= 1
    }
    #endif
}

@inline(__always)
func widen(_ source: UnsafePointer<Float>, toDoubles destination: UnsafeMutablePointer<Double>, count: Int) {
    var k = 0
    while k < count {
        destination[k] = Double(source[k])
        k &+= 1
    }
}

/// The cores the large linear and matmul calls split their outputs across.
let workerCount = max(1, ProcessInfo.processInfo.activeProcessorCount)

/// Multiply-adds below which a call stays on the calling thread. 2^18 take about 15 us on one
/// core; handing parts to the other workers costs a few microseconds when they are awake,
/// more when they must be woken or the cores are shared, which a smaller call would not
/// earn back.
let parallelMultiplyAdds = 1 << 18

/// `body` over consecutive parts of 0..<count that together cover it, each part but the last
/// a multiple of `align` long, in parallel when `work` (multiply-adds) pays for it. A few
/// parts per worker rather than one each, taken as workers come free, so that a core another
/// process slows down takes fewer of them. Every output element is computed by the same code
/// whichever part it falls in, so the results are the same bits however the range is cut.
func forEachPart(of count: Int, align: Int, work: Int, _ body: (Range<Int>) -> Void) {
    let units = (count + align - 1) / align
    let parts = work >= parallelMultiplyAdds ? min(units, 4 * workerCount) : 1
    guard parts > 1, workerCount > 1 else {
        body(0..<count)
        return
    }
    DispatchQueue.concurrentPerform(iterations: parts) { part in
        let start = units * part / parts * align, end = min(units * (part + 1) / parts * align, count)
        if start < end { body(start..<end) }
    }
}

/// `count` float64 values, aligned to a cache line: a 32-byte load at an offset that is a
/// multiple of 32 then never straddles two lines.
func allocateDoubles(_ count: Int) -> UnsafeMutablePointer<Double> {
    UnsafeMutableRawPointer.allocate(byteCount: max(count, 1) * MemoryLayout<Double>.stride, alignment: 64)
        .bindMemory(to: Double.self, capacity: max(count, 1))
}

/// out[m, n] = dot(x[m, :], w[n, :]) (+ bias[n]) for x [M, K] and w [N, K], x widened to
/// float64 once. Rows of x in groups of eight go through `eightRowTile`, which widens each
/// weight row (fp16 or fp32) as it reads it; the rows left over (all of them when M < 8) are
/// dotted with the weight rows three at a time, widened into a scratch block first. Large
/// calls split the weight rows across cores (`forEachPart`), each part with its own scratch.
func rowDots(x: [Float], rows: Int, depth: Int, weight: TensorData, outputs: Int, bias: [Float]?) -> [Float] {
    // Every element is written below.
    var out = [Float](unsafeUninitializedCapacity: rows * outputs) { _, initialized in initialized = rows * outputs }
    let wide = allocateDoubles(rows * depth)
    let groups = rows / 8
    let packed = allocateDoubles(groups * 8 * depth)
    defer {
        wide.deallocate()
        packed.deallocate()
    }
    x.withUnsafeBufferPointer { xs in
        if let source = xs.baseAddress { widen(source, toDoubles: wide, count: rows * depth) }
    }
    interleaveEights(wide, groups: groups, depth: depth, into: packed)
    // The rows after the groups of eight.
    let rest = wide + groups * 8 * depth, restRows = rows - groups * 8
    let floatWeights: [Float]
    if case .float(let values) = weight { floatWeights = values } else { floatWeights = [] }
    out.withUnsafeMutableBufferPointer { result in
        floatWeights.withUnsafeBufferPointer { fw in
            (bias ?? []).withUnsafeBufferPointer { offsets in
                let halfWeights: UnsafePointer<UInt16>?
                if case .half(let storage) = weight { halfWeights = storage.values.baseAddress } else { halfWeights = nil }
                let out = result.baseAddress!
                let offsets = bias == nil ? nil : offsets.baseAddress
                forEachPart(of: outputs, align: 3, work: rows * depth * outputs) { part in
                    for n in part where groups > 0 {
                        let offset = offsets?[n] ?? 0
                        for g in 0..<groups {
                            let interleaved = packed + g &* 8 &* (depth / 4 &* 4), xRows = wide + g &* 8 &* depth
                            let o = out + (g &* 8 &* outputs &+ n)
                            if let halfWeights = halfWeights {
                                eightRowTile(interleaved, xRows, depth, HalfRow(base: halfWeights + n &* depth), depth: depth,
                                             o, outputs, offset: offset)
                            } else {
                                eightRowTile(interleaved, xRows, depth, FloatRow(base: fw.baseAddress! + n &* depth), depth: depth,
                                             o, outputs, offset: offset)
                            }
                        }
                    }
                    guard restRows > 0 else { return }
                    let scratch = allocateDoubles(3 * depth)
                    defer { scratch.deallocate() }
                    func block(_ n: Int, _ count: Int) {
                        if let halfWeights = halfWeights {
                            widen(halfWeights + n &* depth, toDoubles: scratch, count: count &* depth)
                        } else {
                            widen(fw.baseAddress! + n &* depth, toDoubles: scratch, count: count &* depth)
                        }
                    }
                    let restOut = out + groups * 8 * outputs
                    var n = part.lowerBound
                    while n &+ 3 <= part.upperBound {
                        block(n, 3)
                        rowsAgainst(cols: 3, rest, rows: restRows, scratch, depth: depth, restOut + n, outputs, bias: offsets.map { $0 + n })
                        n &+= 3
                    }
                    while n < part.upperBound {
                        block(n, 1)
                        rowsAgainst(cols: 1, rest, rows: restRows, scratch, depth: depth, restOut + n, outputs, bias: offsets.map { $0 + n })
                        n &+= 1
                    }
                }
            }
        }
    }
    return out
}

/// A tensor's values as float64, in a buffer the caller deallocates (never empty).
func wideCopy(_ tensor: Tensor) -> UnsafeMutableBufferPointer<Double> {
    let count = tensor.count
    let buffer = UnsafeMutableBufferPointer<Double>.allocate(capacity: max(count, 1))
    switch tensor.data {
    case .half(let storage):
        if count > 0 { widen(storage.values.baseAddress!, toDoubles: buffer.baseAddress!, count: count) }
    default:
        tensor.floats().withUnsafeBufferPointer { source in
            if count > 0 { widen(source.baseAddress!, toDoubles: buffer.baseAddress!, count: count) }
        }
    }
    return buffer
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
    return tensor.strided(shape, strides: perm.map { strides[$0] }, base: 0)
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
        var x = try args.tensor("x")
        let y = try args.tensor("y")
        guard x.rank >= 2, y.rank >= 2 else { throw KernelError("matmul of rank < 2 (\(x), \(y)) is not supported") }
        let transposeX = try args.bool("transpose_x"), transposeY = try args.bool("transpose_y")
        let m = x.shape[x.rank - (transposeX ? 1 : 2)], k = x.shape[x.rank - (transposeX ? 2 : 1)]
        let n = y.shape[y.rank - (transposeY ? 2 : 1)]
        guard y.shape[y.rank - (transposeY ? 1 : 2)] == k else { throw KernelError("matmul inner sizes differ: \(x) and \(y)") }
        // y's columns are contiguous rows of y^T (copied when y is not transposed, below), or
        // else, for a short depth, the lanes of `columnProducts`, which reads y and x as they are
        // (from four columns). A short dot spends more on `tile`'s sums across lanes than
        // on its multiply-adds; a long one is better in `tile`, which loads fewer operands
        // per multiply-add, even after the copy of y^T.
        let byColumns = !transposeY && n >= 4 && k <= 32
        if !byColumns, transposeX { x = swapLastAxes(x) }
        let xBatch = Array(x.shape.dropLast(2)), yBatch = Array(y.shape.dropLast(2))
        let batch = try broadcastShape([xBatch, yBatch])
        let batches = elementCount(batch)
        let xIndex = broadcastIndices(from: xBatch, to: batch), yIndex = broadcastIndices(from: yBatch, to: batch)
        let xs = wideCopy(x)
        defer { xs.deallocate() }
        // Every element is written below.
        var out = [Float](unsafeUninitializedCapacity: batches * m * n) { _, initialized in initialized = batches * m * n }
        if byColumns {
            let ys = wideCopy(y)
            defer { ys.deallocate() }
            out.withUnsafeMutableBufferPointer { op in
                // The rows of every batch, numbered batch by batch, split across cores.
                let (xRow, xStep) = transposeX ? (1, m) : (k, 1)
                forEachPart(of: batches * m, align: 1, work: batches * m * n * k) { part in
                    var row = part.lowerBound
                    while row < part.upperBound {
                        let b = row / m, i = row - b * m
                        let end = min(part.upperBound, (b + 1) * m)
                        let xBase = xs.baseAddress! + (xIndex?[b] ?? b) * m * k + i * xRow
                        let yBase = ys.baseAddress! + (yIndex?[b] ?? b) * k * n
                        columnProducts(UnsafePointer(xBase), rows: end - row, xRow: xRow, xStep: xStep, UnsafePointer(yBase),
                                       cols: n, ldy: n, depth: k, op.baseAddress! + b * m * n + i * n, n)
                        row = end
                    }
                }
            }
            return [.floats(out, shape: batch + [m, n])]
        }
        // The output columns of every batch, numbered batch by batch, split across cores. Each
        // part widens the rows of y^T it reads into a scratch of its own (for y not transposed,
        // its columns of y, copied row by row of y): the copy of y^T, and its widening, are
        // split with the products instead of made whole before them.
        let yValues = y.floats()
        yValues.withUnsafeBufferPointer { yv in
            out.withUnsafeMutableBufferPointer { op in
                forEachPart(of: batches * n, align: 3, work: batches * m * n * k) { part in
                    let scratch = allocateDoubles(min(part.count, n) * k)
                    defer { scratch.deallocate() }
                    var column = part.lowerBound
                    while column < part.upperBound {
                        let b = column / n, j = column - b * n
                        let end = min(part.upperBound, (b + 1) * n)
                        let count = end - column
                        let yb = yv.baseAddress! + (yIndex?[b] ?? b) * n * k
                        if transposeY {
                            widen(yb + j * k, toDoubles: scratch, count: count * k)
                        } else {
                            // Eight rows of y at a time: each column's eight values fill one
                            // cache line of the scratch, and the eight lines of y stay in cache
                            // across the columns.
                            var k0 = 0
                            while k0 < k {
                                let k1 = min(k0 &+ 8, k)
                                for c in 0..<count {
                                    let to = scratch + (c &* k)
                                    let from = yb + (j &+ c)
                                    for kk in k0..<k1 { to[kk] = Double(from[kk &* n]) }
                                }
                                k0 = k1
                            }
                        }
                        let xBase = xs.baseAddress! + (xIndex?[b] ?? b) * m * k
                        rowProducts(UnsafePointer(xBase), rows: m, UnsafePointer(scratch), cols: count, depth: k,
                                    op.baseAddress! + b * m * n + j, n)
                        column = end
                    }
                }
            }
        }
        return [.floats(out, shape: batch + [m, n])]
    },
]
