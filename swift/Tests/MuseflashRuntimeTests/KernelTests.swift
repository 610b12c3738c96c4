import Foundation
@_spi(Testing) import MILInterpreter
import MuseflashRuntime
import XCTest

/// The interpreter's fast kernels (register tiles for linear and matmul, broadcasting by rows,
/// strided copies, fp16 look-up tables, F16C rounding) against the plain definitions written out
/// here, element by element. Both interpreters promise the same bits (docs/swift-runtime.md), so
/// every comparison is of bit patterns, not within a tolerance.
final class KernelTests: XCTestCase {
    // MARK: - Values

    /// fp16 bit patterns: mostly ordinary values of either sign, some zeros of both signs,
    /// subnormals, and large values near the top of the range.
    static func halfBits(_ count: Int, _ generator: inout SeededGenerator) -> [UInt16] {
        (0..<count).map { _ in
            let r = generator.next()
            let sign = UInt16(truncatingIfNeeded: r >> 63) << 15
            switch r % 16 {
            case 0: return sign
            case 1: return sign | UInt16(truncatingIfNeeded: (r >> 8) & 0x3FF)  // subnormal
            case 2: return sign | 0x7800 | UInt16(truncatingIfNeeded: (r >> 8) & 0x3FF)  // 2^15 and up
            default: return sign | (0x3000 + UInt16(truncatingIfNeeded: (r >> 8) % 0x1800))  // 2^-3 ... 2^3
            }
        }
    }

    static func halfValues(_ count: Int, _ generator: inout SeededGenerator) -> [Float] {
        halfBits(count, &generator).map(Half.toFloat)
    }

    static func fp16(_ values: [Float], _ shape: [Int]) -> Tensor { .floats(values, shape: shape, type: .float16) }

    static func ints(_ values: [Int]) -> Tensor { .ints(values.map { Int32($0) }, shape: [values.count]) }

    static func bools(_ values: [Bool]) -> Tensor { .bools(values, shape: [values.count]) }

    static func run(_ op: String, _ inputs: [String: Tensor], as type: ElementType = .float32) throws -> Tensor {
        try XCTUnwrap(runKernel(op, inputs.mapValues { [$0] }, outputTypes: [type]).first)
    }

    func assertSameBits(_ got: Tensor, _ want: [Float], shape: [Int], _ what: String, file: StaticString = #filePath, line: UInt = #line) {
        XCTAssertEqual(got.shape, shape, what, file: file, line: line)
        let values = got.floats()
        XCTAssertEqual(values.count, want.count, what, file: file, line: line)
        var wrong = 0
        for (a, b) in zip(values, want) where a.bitPattern != b.bitPattern && !(a.isNaN && b.isNaN) {
            if wrong == 0 { XCTFail("\(what): \(a) where \(b) is expected", file: file, line: line) }
            wrong += 1
        }
        if wrong > 1 { XCTFail("\(what): \(wrong) of \(want.count) elements differ", file: file, line: line) }
    }

    // MARK: - References

    /// The numerics rule's dot product: four float64 chains (k = j mod 4, in increasing k, the
    /// remainder on the first), added as (s0 + s1) + (s2 + s3) and rounded once to fp32.
    static func dot(_ a: ArraySlice<Float>, _ b: ArraySlice<Float>) -> Float {
        let a = Array(a), b = Array(b)
        var sums = [0.0, 0.0, 0.0, 0.0]
        var k = 0
        while k + 4 <= a.count {
            for j in 0..<4 { sums[j] = sums[j] + Double(a[k + j]) * Double(b[k + j]) }
            k += 4
        }
        while k < a.count {
            sums[0] = sums[0] + Double(a[k]) * Double(b[k])
            k += 1
        }
        return Float((sums[0] + sums[1]) + (sums[2] + sums[3]))
    }

    static func strides(_ shape: [Int]) -> [Int] {
        var result = [Int](repeating: 1, count: shape.count)
        var running = 1
        for axis in shape.indices.reversed() {
            result[axis] = running
            running *= shape[axis]
        }
        return result
    }

    static func coordinates(_ index: Int, _ shape: [Int]) -> [Int] {
        var rest = index
        return strides(shape).enumerated().map { axis, stride in
            let coordinate = rest / stride
            rest %= stride
            return shape[axis] == 0 ? 0 : coordinate
        }
    }

    /// numpy broadcasting: the element of `shape` that output coordinates `at` read.
    static func broadcastIndex(_ at: [Int], from shape: [Int]) -> Int {
        let padded = [Int](repeating: 1, count: at.count - shape.count) + shape
        let stride = strides(padded)
        return padded.indices.reduce(0) { $0 + (padded[$1] == 1 ? 0 : at[$1] * stride[$1]) }
    }

    static func broadcastShape(_ a: [Int], _ b: [Int]) -> [Int] {
        let rank = max(a.count, b.count)
        let pa = [Int](repeating: 1, count: rank - a.count) + a, pb = [Int](repeating: 1, count: rank - b.count) + b
        return zip(pa, pb).map { $0 == 1 ? $1 : $0 }
    }

    // MARK: - linear and matmul

    func testLinearTilesEqualTheFourChainDot() throws {
        var generator = SeededGenerator(seed: 11)
        for rows in [1, 2, 3, 4, 5, 7, 8, 11, 16] {
            for depth in [1, 3, 4, 5, 8, 13, 64] {
                for outputs in [1, 2, 3, 4, 5, 7, 10] {
                    let x = Self.halfValues(rows * depth, &generator)
                    let bits = Self.halfBits(outputs * depth, &generator)
                    let w = bits.map(Half.toFloat)
                    let bias = Self.halfValues(outputs, &generator)
                    let mapped = Tensor(shape: [outputs, depth], type: .float16, data: .half(HalfStorage(fp16Bits: bits)))
                    let variants: [(String, Tensor, Tensor?)] = [
                        ("fp16 weights in place, bias", mapped, Self.fp16(bias, [outputs])),
                        ("fp16 weights in place, no bias", mapped, nil),
                        ("fp32 weights", .floats(w, shape: [outputs, depth]), nil),
                    ]
                    for (what, weight, b) in variants {
                        var inputs = ["x": Self.fp16(x, [1, rows, depth]), "weight": weight]
                        if let b = b { inputs["bias"] = b }
                        let got = try Self.run("linear", inputs)
                        var want: [Float] = []
                        for m in 0..<rows {
                            for n in 0..<outputs {
                                let d = Self.dot(x[(m * depth)..<((m + 1) * depth)], w[(n * depth)..<((n + 1) * depth)])
                                want.append(b == nil ? d : d + bias[n])
                            }
                        }
                        assertSameBits(got, want, shape: [1, rows, outputs], "linear \(rows)x\(depth)x\(outputs), \(what)")
                    }
                }
            }
        }
    }

    /// Rows of x and w whose products cancel: some pairs of adjacent columns hold +-2^15 with
    /// products of opposite sign (+-2^30, cancelling exactly), the other columns values near
    /// 2^-10 (products near 2^-20, whose bits a partial sum near 2^30 drops). The two columns
    /// of a pair go to different chains, so the float64 sums depend on their order and only the
    /// four chains, in their order, give the expected bits.
    static func cancellingRows(rows: Int, outputs: Int, depth: Int, _ generator: inout SeededGenerator) -> ([Float], [Float]) {
        func small() -> Float {
            let r = generator.next()
            return Half.toFloat((r & 1 == 0 ? 0 : 0x8000) | 0x1800 | UInt16(truncatingIfNeeded: (r >> 8) & 0x3FF))
        }
        func big() -> Float { generator.next() % 2 == 0 ? 32768 : -32768 }
        var x = [Float](repeating: 0, count: rows * depth), w = [Float](repeating: 0, count: outputs * depth)
        var k = 0
        while k < depth {
            if k + 1 < depth, generator.next() % 2 == 0 {
                for m in 0..<rows { x[m * depth + k] = big(); x[m * depth + k + 1] = x[m * depth + k] }
                for n in 0..<outputs { w[n * depth + k] = big(); w[n * depth + k + 1] = -w[n * depth + k] }
                k += 2
            } else {
                for m in 0..<rows { x[m * depth + k] = small() }
                for n in 0..<outputs { w[n * depth + k] = small() }
                k += 1
            }
        }
        return (x, w)
    }

    func testTilesKeepTheOrderOfTheFourChains() throws {
        var generator = SeededGenerator(seed: 19)
        var orderSensitive = 0
        for rows in [1, 3, 4, 5, 9] {
            for depth in [5, 8, 13, 19, 32] {
                for outputs in [1, 2, 3, 4, 7] {
                    let (x, w) = Self.cancellingRows(rows: rows, outputs: outputs, depth: depth, &generator)
                    let bits = w.map(Half.fromFloat)
                    let weight = Tensor(shape: [outputs, depth], type: .float16, data: .half(HalfStorage(fp16Bits: bits)))
                    let got = try Self.run("linear", ["x": Self.fp16(x, [rows, depth]), "weight": weight])
                    let product = try Self.run("matmul", ["x": Self.fp16(x, [rows, depth]), "y": Self.fp16(w, [outputs, depth]),
                                                          "transpose_y": .bools([true], shape: [])])
                    // y as [depth, outputs]: from 4 outputs on, its columns are the lanes of
                    // matmul's column tiles.
                    let columns = (0..<(depth * outputs)).map { w[($0 % outputs) * depth + $0 / outputs] }
                    let byColumns = try Self.run("matmul", ["x": Self.fp16(x, [rows, depth]), "y": Self.fp16(columns, [depth, outputs])])
                    var want: [Float] = []
                    for m in 0..<rows {
                        for n in 0..<outputs {
                            let a = x[(m * depth)..<((m + 1) * depth)], b = w[(n * depth)..<((n + 1) * depth)]
                            want.append(Self.dot(a, b))
                            let inOrder = Float(zip(a, b).reduce(0.0) { $0 + Double($1.0) * Double($1.1) })
                            if inOrder.bitPattern != want.last!.bitPattern { orderSensitive += 1 }
                        }
                    }
                    assertSameBits(got, want, shape: [rows, outputs], "linear \(rows)x\(depth)x\(outputs), cancelling values")
                    assertSameBits(product, want, shape: [rows, outputs], "matmul \(rows)x\(depth)x\(outputs), cancelling values")
                    assertSameBits(byColumns, want, shape: [rows, outputs], "matmul \(rows)x\(depth)x\(outputs) by columns, cancelling values")
                }
            }
        }
        // The data must be able to tell orders apart for the comparison to mean anything.
        XCTAssertGreaterThan(orderSensitive, 500)
    }

    /// Calls large enough to be split across cores (LinearAlgebra.swift's `forEachPart`, from
    /// 2^18 multiply-adds): every element is still the one four-chain dot, whatever part of
    /// the output it falls in, with values whose sums tell the chains' orders apart.
    func testLinearSplitAcrossCoresEqualsTheFourChainDot() throws {
        var generator = SeededGenerator(seed: 23)
        let rows = 8, depth = 101, outputs = 700
        XCTAssertGreaterThan(rows * depth * outputs, 1 << 18)
        let (x, w) = Self.cancellingRows(rows: rows, outputs: outputs, depth: depth, &generator)
        let bias = Self.halfValues(outputs, &generator)
        let weight = Tensor(shape: [outputs, depth], type: .float16, data: .half(HalfStorage(fp16Bits: w.map(Half.fromFloat))))
        let got = try Self.run("linear", ["x": Self.fp16(x, [1, rows, depth]), "weight": weight, "bias": Self.fp16(bias, [outputs])])
        var want: [Float] = []
        for m in 0..<rows {
            for n in 0..<outputs {
                want.append(Self.dot(x[(m * depth)..<((m + 1) * depth)], w[(n * depth)..<((n + 1) * depth)]) + bias[n])
            }
        }
        assertSameBits(got, want, shape: [1, rows, outputs], "linear \(rows)x\(depth)x\(outputs) split across cores")
    }

    /// fp32 inputs that are not fp16 values: products of two fp32 values are still exact in
    /// float64, so a fused multiply-add gives the same sums.
    func testLinearOnFp32ValuesEqualsTheFourChainDot() throws {
        var generator = SeededGenerator(seed: 12)
        let rows = 6, depth = 37, outputs = 11
        let x = (0..<(rows * depth)).map { _ in Float.random(in: -4...4, using: &generator) }
        let w = (0..<(outputs * depth)).map { _ in Float.random(in: -1...1, using: &generator) * 1e-3 }
        let got = try Self.run("linear", ["x": .floats(x, shape: [rows, depth]), "weight": .floats(w, shape: [outputs, depth])])
        var want: [Float] = []
        for m in 0..<rows {
            for n in 0..<outputs { want.append(Self.dot(x[(m * depth)..<((m + 1) * depth)], w[(n * depth)..<((n + 1) * depth)])) }
        }
        assertSameBits(got, want, shape: [rows, outputs], "fp32 linear")
    }

    func testMatmulEqualsTheFourChainDot() throws {
        var generator = SeededGenerator(seed: 13)
        let cases: [([Int], [Int], Bool, Bool)] = [
            ([5, 7], [7, 6], false, false),
            ([1, 32, 64], [1, 256, 64], false, true),
            ([1, 9, 13], [1, 13, 5], false, false),
            ([2, 1, 6, 4], [3, 4, 5], false, false),
            ([16, 9], [1, 16, 7], true, false),
            ([2, 3, 6], [2, 5, 3], true, true),
            // Large enough to be split across cores: attention's shapes and the KV blend's.
            ([3, 24, 64], [3, 256, 64], false, true),
            ([3, 24, 256], [3, 256, 64], false, false),
            ([8, 256], [3, 8, 64], true, false),
        ]
        for (xShape, yShape, tx, ty) in cases {
            let xs = Self.halfValues(xShape.reduce(1, *), &generator), ys = Self.halfValues(yShape.reduce(1, *), &generator)
            let got = try Self.run("matmul", ["x": Self.fp16(xs, xShape), "y": Self.fp16(ys, yShape),
                                              "transpose_x": .bools([tx], shape: []), "transpose_y": .bools([ty], shape: [])])
            // Element (i, j) of the last two axes of x (or x^T) and y (or y^T).
            func xAt(_ batch: [Int], _ i: Int, _ k: Int) -> Float {
                let at = batch + (tx ? [k, i] : [i, k])
                return xs[Self.broadcastIndex(Array(at.suffix(xShape.count)), from: xShape)]
            }
            func yAt(_ batch: [Int], _ k: Int, _ j: Int) -> Float {
                let at = batch + (ty ? [j, k] : [k, j])
                return ys[Self.broadcastIndex(Array(at.suffix(yShape.count)), from: yShape)]
            }
            let m = tx ? xShape[xShape.count - 1] : xShape[xShape.count - 2]
            let depth = tx ? xShape[xShape.count - 2] : xShape[xShape.count - 1]
            let n = ty ? yShape[yShape.count - 2] : yShape[yShape.count - 1]
            let batch = Self.broadcastShape(Array(xShape.dropLast(2)), Array(yShape.dropLast(2)))
            var want: [Float] = []
            for b in 0..<batch.reduce(1, *) {
                let at = Self.coordinates(b, batch)
                let rows = (0..<m).map { i in (0..<depth).map { xAt(at, i, $0) }[...] }
                let columns = (0..<n).map { j in (0..<depth).map { yAt(at, $0, j) }[...] }
                for i in 0..<m {
                    for j in 0..<n { want.append(Self.dot(rows[i], columns[j])) }
                }
            }
            assertSameBits(got, want, shape: batch + [m, n], "matmul \(xShape) \(yShape) \(tx) \(ty)")
        }
    }

    // MARK: - Broadcasting

    static let shapePairs: [([Int], [Int])] = [
        ([1, 16, 128], [128]), ([1, 16, 128], [1, 16, 1]), ([2, 16, 64], [16, 64]), ([16, 1], [1, 256]),
        ([3, 1, 5], [1, 4, 1]), ([], [2, 3]), ([2, 3], []), ([4, 1, 3], [4, 2, 1]), ([2, 3], [2, 3]),
        ([2, 1, 3, 1], [5, 1, 2]), ([1], [7]), ([0, 3], [3]),
    ]

    func testBinaryOpsBroadcastAsNumpyDoes() throws {
        var generator = SeededGenerator(seed: 14)
        let ops: [(String, (Float, Float) -> Float)] = [
            ("add", { $0 + $1 }), ("sub", { $0 - $1 }), ("mul", { $0 * $1 }), ("real_div", { $0 / $1 }),
            ("maximum", { $0.isNaN || $1.isNaN ? .nan : Swift.max($0, $1) }),
            ("minimum", { $0.isNaN || $1.isNaN ? .nan : Swift.min($0, $1) }),
            ("pow", { $1 == 2 ? $0 * $0 : Float(Foundation.pow(Double($0), Double($1))) }),
        ]
        for (xShape, yShape) in Self.shapePairs {
            let shape = Self.broadcastShape(xShape, yShape)
            let x = Self.halfValues(xShape.reduce(1, *), &generator)
            var y = Self.halfValues(yShape.reduce(1, *), &generator)
            for (name, f) in ops {
                if name == "pow" { y = y.map { $0 < 0 ? 2 : Half.round($0.squareRoot()) } }
                let got = try Self.run(name, ["x": Self.fp16(x, xShape), "y": Self.fp16(y, yShape)])
                let want = (0..<shape.reduce(1, *)).map { index -> Float in
                    let at = Self.coordinates(index, shape)
                    return f(x[Self.broadcastIndex(at, from: xShape)], y[Self.broadcastIndex(at, from: yShape)])
                }
                assertSameBits(got, want, shape: shape, "\(name) \(xShape) \(yShape)")
            }
            let xi = (0..<xShape.reduce(1, *)).map { _ in Int32(truncatingIfNeeded: generator.next() % 200) - 100 }
            let yi = (0..<yShape.reduce(1, *)).map { _ in Int32(truncatingIfNeeded: generator.next() % 200) - 100 }
            let sum = try Self.run("add", ["x": .ints(xi, shape: xShape), "y": .ints(yi, shape: yShape)], as: .int32)
            let atLeast = try Self.run("greater_equal", ["x": .ints(xi, shape: xShape), "y": .ints(yi, shape: yShape)], as: .bool)
            var wantSum: [Int32] = [], wantAtLeast: [Bool] = []
            for index in 0..<shape.reduce(1, *) {
                let at = Self.coordinates(index, shape)
                let a = xi[Self.broadcastIndex(at, from: xShape)], b = yi[Self.broadcastIndex(at, from: yShape)]
                wantSum.append(a &+ b)
                wantAtLeast.append(a >= b)
            }
            XCTAssertEqual(sum.ints(), wantSum, "int add \(xShape) \(yShape)")
            XCTAssertEqual(atLeast.bools(), wantAtLeast, "greater_equal \(xShape) \(yShape)")
            XCTAssertEqual(atLeast.shape, shape)
        }
    }

    func testSelectBroadcastsItsThreeInputs() throws {
        var generator = SeededGenerator(seed: 15)
        let cases: [([Int], [Int], [Int])] = [
            ([1, 96, 64], [1, 96, 64], [1, 96, 64]), ([16, 1], [1, 5], []), ([3, 1, 4], [1, 2, 1], [2, 4]), ([2, 2], [2, 2], [1]),
        ]
        for (cShape, aShape, bShape) in cases {
            let shape = Self.broadcastShape(Self.broadcastShape(cShape, aShape), bShape)
            let flags = (0..<cShape.reduce(1, *)).map { _ in generator.next() % 2 == 0 }
            let a = Self.halfValues(aShape.reduce(1, *), &generator), b = Self.halfValues(bShape.reduce(1, *), &generator)
            let got = try Self.run("select", ["cond": .bools(flags, shape: cShape), "a": Self.fp16(a, aShape), "b": Self.fp16(b, bShape)])
            let want = (0..<shape.reduce(1, *)).map { index -> Float in
                let at = Self.coordinates(index, shape)
                return flags[Self.broadcastIndex(at, from: cShape)] ? a[Self.broadcastIndex(at, from: aShape)] : b[Self.broadcastIndex(at, from: bShape)]
            }
            assertSameBits(got, want, shape: shape, "select \(cShape) \(aShape) \(bShape)")
        }
    }

    // MARK: - Look-up tables and rounding

    static func sigmoid(_ x: Float) -> Float {
        let e = Float(Foundation.exp(Double(-Swift.abs(x))))
        return x >= 0 ? 1 / (1 + e) : e / (1 + e)
    }

    /// Every fp16 value, in place and as fp32 values, through the tabulated ops: what the
    /// function gives on that value, NaNs included; an fp16-typed value that is not an fp16 is
    /// computed, not looked up.
    func testTabulatedOpsGiveTheFunctionOfEveryFp16Value() throws {
        let bits = (0...UInt16.max).map { $0 }
        let values = bits.map(Half.toFloat)
        let functions: [(String, (Float) -> Float)] = [
            ("tanh", { Float(Foundation.tanh(Double($0))) }), ("exp", { Float(Foundation.exp(Double($0))) }),
            ("sigmoid", Self.sigmoid), ("silu", { $0 * Self.sigmoid($0) }), ("sin", { Float(Foundation.sin(Double($0))) }),
        ]
        for (name, f) in functions {
            let want = values.map(f)
            let mapped = Tensor(shape: [bits.count], type: .float16, data: .half(HalfStorage(fp16Bits: bits)))
            assertSameBits(try Self.run(name, ["x": mapped]), want, shape: [bits.count], "\(name) of fp16 weights")
            assertSameBits(try Self.run(name, ["x": Self.fp16(values, [bits.count])]), want, shape: [bits.count], "\(name) of fp16 values")
            var odd = Array(values.prefix(2048))
            odd[5] = 0.1
            odd[700] = Float(bitPattern: 0x7FC0_1234)
            assertSameBits(try Self.run(name, ["x": Self.fp16(odd, [odd.count])]), odd.map(f), shape: [odd.count], "\(name) of values that are not all fp16")
        }
    }

    func testSoftmaxEqualsItsDefinition() throws {
        var generator = SeededGenerator(seed: 16)
        for (shape, axis) in [([2, 3, 96], -1), ([2, 40, 3], 1), ([1, 2, 16, 256], 3)] {
            var x = Self.halfValues(shape.reduce(1, *), &generator)
            for index in x.indices where generator.next() % 7 == 0 { x[index] = generator.next() % 2 == 0 ? -65504 : -.infinity }
            let got = try Self.run("softmax", ["x": Self.fp16(x, shape), "axis": .ints([Int32(axis)], shape: [])], as: .float16)
            let a = axis < 0 ? axis + shape.count : axis
            let inner = shape[(a + 1)...].reduce(1, *), size = shape[a]
            var want = x
            for outer in 0..<(x.count / (size * inner)) {
                for i in 0..<inner {
                    let lane = (0..<size).map { (outer * size + $0) * inner + i }
                    let peak = lane.map { x[$0] }.max()!
                    let e = lane.map { Float(Foundation.exp(Double(x[$0] - peak))) }
                    let total = Float(e.reduce(0.0) { $0 + Double($1) })
                    for (position, index) in lane.enumerated() { want[index] = Half.round(e[position] / total) }
                }
            }
            assertSameBits(got, want, shape: shape, "softmax \(shape) axis \(axis)")
        }
    }

    func testReduceSumAndMeanAddInOrderInFloat64() throws {
        var generator = SeededGenerator(seed: 17)
        let shape = [3, 5, 130]
        let x = Self.halfValues(shape.reduce(1, *), &generator)
        for axis in 0..<3 {
            for (name, mean) in [("reduce_sum", false), ("reduce_mean", true)] {
                let got = try Self.run(name, ["x": Self.fp16(x, shape), "axes": Self.ints([axis - 3]), "keep_dims": .bools([true], shape: [])])
                var outShape = shape
                outShape[axis] = 1
                let want = (0..<outShape.reduce(1, *)).map { index -> Float in
                    var at = Self.coordinates(index, outShape)
                    var total = 0.0
                    for k in 0..<shape[axis] {
                        at[axis] = k
                        total += Double(x[Self.broadcastIndex(at, from: shape)])
                    }
                    return mean ? Float(total) / Float(shape[axis]) : Float(total)
                }
                assertSameBits(got, want, shape: outShape, "\(name) axis \(axis)")
            }
        }
    }

    /// reduce_max and reduce_min along each axis (the last one's lanes are copied whole), with
    /// zeros of both signs, where the first zero of the lane wins.
    func testReduceMaxAndMinPickAlongEachAxis() throws {
        var generator = SeededGenerator(seed: 18)
        let shape = [3, 5, 130]
        let x = Self.halfValues(shape.reduce(1, *), &generator).map { generator.next() % 4 == 0 ? -Swift.abs($0) : $0 }
        for axis in 0..<3 {
            for (name, larger) in [("reduce_max", true), ("reduce_min", false)] {
                let got = try Self.run(name, ["x": Self.fp16(x, shape), "axes": Self.ints([axis - 3]), "keep_dims": .bools([true], shape: [])])
                var outShape = shape
                outShape[axis] = 1
                let want = (0..<outShape.reduce(1, *)).map { index -> Float in
                    var at = Self.coordinates(index, outShape)
                    let lane = (0..<shape[axis]).map { k -> Float in
                        at[axis] = k
                        return x[Self.broadcastIndex(at, from: shape)]
                    }
                    return (larger ? lane.max() : lane.min())!
                }
                assertSameBits(got, want, shape: outShape, "\(name) axis \(axis)")
            }
        }
    }

    /// The fp16 rounding of every op's fp32 result: the scalar definition, for values around
    /// every rounding boundary, subnormals, overflow and NaNs with payloads (a NaN comes out as
    /// the quiet NaN of its sign).
    func testRoundingAnOutputToFp16IsTheScalarRounding() {
        var generator = SeededGenerator(seed: 18)
        var values: [Float] = [0, -0, 65504, 65519.996, 65520, -65520, .infinity, -.infinity, .leastNonzeroMagnitude,
                               Float(bitPattern: 0x3880_0000), Float(bitPattern: 0x387F_FFFF), Float(bitPattern: 0x3300_0000),
                               Float(bitPattern: 0x3300_0001), Float(bitPattern: 0x7FC0_0000), Float(bitPattern: 0xFFC0_0000),
                               Float(bitPattern: 0x7FE0_1000), Float(bitPattern: 0xFF80_0001), Float(bitPattern: 0x7F80_2000)]
        for index in 0..<100_000 {
            var bits = UInt32(truncatingIfNeeded: generator.next())
            if index % 2 == 0 { bits = (bits & 0x83FF_FFFF) | 0x3800_0000 }
            values.append(Float(bitPattern: bits))
        }
        let rounded = Tensor.floats(values, shape: [values.count]).converted(to: .float16).floats()
        for (value, got) in zip(values, rounded) {
            let want = value.isNaN ? Float(bitPattern: 0x7FC0_0000 | (value.bitPattern & 0x8000_0000)) : Half.round(value)
            XCTAssertEqual(got.bitPattern, want.bitPattern, "fp16 rounding of 0x\(String(value.bitPattern, radix: 16))")
        }
    }

    // MARK: - Strided copies

    /// Python's range of `slice(start, stop, step)` over `size` elements.
    static func sliceRange(_ start: Int?, _ stop: Int?, _ step: Int, _ size: Int) -> [Int] {
        func clamp(_ value: Int, _ low: Int, _ high: Int) -> Int { Swift.min(Swift.max(value, low), high) }
        if step > 0 {
            let first = start.map { $0 < 0 ? clamp($0 + size, 0, size) : clamp($0, 0, size) } ?? 0
            let end = stop.map { $0 < 0 ? clamp($0 + size, 0, size) : clamp($0, 0, size) } ?? size
            return Array(stride(from: first, to: end, by: step))
        }
        let first = start.map { $0 < 0 ? clamp($0 + size, -1, size - 1) : clamp($0, -1, size - 1) } ?? size - 1
        let end = stop.map { $0 < 0 ? clamp($0 + size, -1, size - 1) : clamp($0, -1, size - 1) } ?? -1
        return Array(stride(from: first, to: end, by: step))
    }

    /// The element at `at` of a row-major tensor of `shape`.
    static func element(_ values: [Float], _ shape: [Int], _ at: [Int]) -> Float {
        values[zip(at, strides(shape)).reduce(0) { $0 + $1.0 * $1.1 }]
    }

    /// Every combination of per-axis index lists, in row-major order.
    static func product(_ axes: [[Int]]) -> [[Int]] {
        axes.reduce([[]]) { partial, axis in partial.flatMap { prefix in axis.map { prefix + [$0] } } }
    }

    func testSlicesEqualPythonSlicing() throws {
        let shape = [3, 4, 6]
        let x = (0..<72).map { Float($0) - 20 }
        let cases: [([Int], [Int], [Int], [Bool], [Bool], [Bool])] = [
            ([1, 0, 4], [3, 4, 0], [1, 2, -2], [false, false, false], [false, false, false], [false, false, false]),
            ([0, 1, 0], [0, 3, 6], [1, 1, 1], [true, false, false], [true, false, false], [false, false, false]),
            ([2, 0, -1], [3, 4, -7], [1, 1, -1], [false, true, false], [false, true, false], [true, false, false]),
            ([0, 3, 1], [3, 4, 5], [2, 1, 3], [false, false, false], [false, false, false], [false, true, false]),
            ([0, 0, 2], [3, 4, 3], [1, 1, 1], [false, false, false], [false, false, false], [false, false, true]),
        ]
        for (begin, end, step, beginMask, endMask, squeeze) in cases {
            let inputs: [String: Tensor] = [
                "x": Self.fp16(x, shape), "begin": Self.ints(begin), "end": Self.ints(end), "stride": Self.ints(step),
                "begin_mask": Self.bools(beginMask), "end_mask": Self.bools(endMask), "squeeze_mask": Self.bools(squeeze),
            ]
            let axes = (0..<3).map { axis -> [Int] in
                if squeeze[axis] { return [begin[axis] < 0 ? begin[axis] + shape[axis] : begin[axis]] }
                return Self.sliceRange(beginMask[axis] ? nil : begin[axis], endMask[axis] ? nil : end[axis], step[axis], shape[axis])
            }
            let outShape = (0..<3).filter { !squeeze[$0] }.map { axes[$0].count }
            let picked = Self.product(axes)
            let got = try Self.run("slice_by_index", inputs, as: .float16)
            assertSameBits(got, picked.map { Self.element(x, shape, $0) }, shape: outShape, "slice \(begin) \(end) \(step)")

            let update = (0..<picked.count).map { Float($0) * 0.5 + 100 }
            var updateInputs = inputs
            updateInputs["update"] = Self.fp16(update, outShape)
            var want = x
            for (position, at) in picked.enumerated() { want[zip(at, Self.strides(shape)).reduce(0) { $0 + $1.0 * $1.1 }] = update[position] }
            assertSameBits(try Self.run("slice_update", updateInputs, as: .float16), want, shape: shape, "slice_update \(begin) \(end) \(step)")
        }
    }

    func testTransposeSplitAndTileCopyTheRightElements() throws {
        let shape = [2, 3, 4]
        let x = (0..<24).map { Float($0) }
        for perm in [[0, 1, 2], [2, 1, 0], [1, 0, 2], [0, 2, 1], [2, 0, 1], [1, 2, 0]] {
            let outShape = perm.map { shape[$0] }
            let want = Self.product(outShape.map { Array(0..<$0) }).map { at -> Float in
                var source = [0, 0, 0]
                for (axis, from) in perm.enumerated() { source[from] = at[axis] }
                return Self.element(x, shape, source)
            }
            assertSameBits(try Self.run("transpose", ["x": Self.fp16(x, shape), "perm": Self.ints(perm)]), want, shape: outShape, "transpose \(perm)")
        }
        let parts = try runKernel("split", ["x": [Self.fp16(x, shape)], "axis": [Self.ints([2])], "split_sizes": [Self.ints([1, 3])]],
                                  outputTypes: [.float16, .float16])
        for (part, range) in zip(parts, [0..<1, 1..<4]) {
            let want = Self.product([Array(0..<2), Array(0..<3), Array(range)]).map { Self.element(x, shape, $0) }
            assertSameBits(part, want, shape: [2, 3, range.count], "split part \(range)")
        }
        for (source, reps) in [([1, 3, 1], [2, 1, 4]), ([2, 3, 4], [1, 2, 1])] {
            let values = (0..<source.reduce(1, *)).map { Float($0) + 1 }
            let outShape = zip(source, reps).map { $0 * $1 }
            let want = Self.product(outShape.map { Array(0..<$0) }).map { at in Self.element(values, source, zip(at, source).map { $0 % $1 }) }
            assertSameBits(try Self.run("tile", ["x": Self.fp16(values, source), "reps": Self.ints(reps)]), want, shape: outShape, "tile \(source) \(reps)")
        }
    }

    /// The constexpr decompressions read, for each element, the scale, offset or look-up table
    /// of its block: (coordinate / block width) along every axis, row-major in the grid.
    func testDecompressionReadsEachElementsBlock() throws {
        var generator = SeededGenerator(seed: 29)
        let cases: [([Int], [Int])] = [([6, 8], [3, 2]), ([4, 6, 10], [2, 3, 5]), ([5, 12], [5, 1]), ([3, 4, 8], [1, 4, 8]),
                                       ([7], [7]), ([2, 3], [1, 1]), ([2, 1, 4, 6], [2, 1, 2, 3])]
        for (shape, grid) in cases {
            let count = shape.reduce(1, *)
            let blockOf = Self.product(shape.map { Array(0..<$0) }).map { at in
                zip(zip(at, zip(shape, grid).map { $0 / $1 }).map { $0 / $1 }, Self.strides(grid)).reduce(0) { $0 + $1.0 * $1.1 }
            }
            let data = (0..<count).map { _ in Int32(generator.next() % 16) - 8 }
            let scales = Self.halfValues(grid.reduce(1, *), &generator), offsets = Self.halfValues(grid.reduce(1, *), &generator)
            let shifted = try Self.run("constexpr_blockwise_shift_scale", [
                "data": .ints(data, shape: shape, type: .int8), "scale": Self.fp16(scales, grid), "offset": Self.fp16(offsets, grid),
            ], as: .float16)
            let want = (0..<count).map { Half.round(Half.round(Float(data[$0]) - offsets[blockOf[$0]]) * scales[blockOf[$0]]) }
            assertSameBits(shifted, want, shape: shape, "shift and scale \(shape) in \(grid)")

            let entries = 4
            let picks = (0..<count).map { _ in Int32(generator.next() % UInt64(entries)) }
            let table = Self.halfValues(grid.reduce(1, *) * entries, &generator)
            let dense = try Self.run("constexpr_lut_to_dense", [
                "indices": .ints(picks, shape: shape, type: .uint8), "lut": Self.fp16(table, grid + [entries, 1]),
            ], as: .float16)
            assertSameBits(dense, (0..<count).map { table[blockOf[$0] * entries + Int(picks[$0])] }, shape: shape,
                           "look-up table \(shape) in \(grid)")
        }
    }

    /// forEachOffset visits every element once in row-major order, at the offset its
    /// coordinates give with the strides: rows padded, scalars spread, axes of one, and arrays
    /// of rank 0 and of no elements.
    func testForEachOffsetWalksEveryElementAtItsStrides() {
        let cases: [([Int], [Int])] = [([], []), ([5], [1]), ([5], [3]), ([2, 3], [3, 1]), ([2, 3], [8, 1]), ([2, 3, 4], [34, 11, 2]),
                                       ([1, 1, 7], [7, 7, 1]), ([3, 1, 2, 2], [9, 100, 4, 1]), ([0, 3], [3, 1]), ([4, 0, 2], [2, 2, 1])]
        for (shape, strides) in cases {
            let want = Self.product(shape.map { Array(0..<$0) }).map { at in zip(at, strides).reduce(0) { $0 + $1.0 * $1.1 } }
            var got: [Int] = [], indices: [Int] = []
            forEachOffset(shape: shape, strides: strides) { index, offset in
                indices.append(index)
                got.append(offset)
            }
            XCTAssertEqual(got, want, "offsets of \(shape) at \(strides)")
            XCTAssertEqual(indices, Array(0..<want.count), "indices of \(shape)")
        }
    }
}
