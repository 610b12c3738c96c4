import MILInterpreter
import MuseflashRuntime
import XCTest

/// The interpreter's own fp16 conversions (MILInterpreter/Half.swift) against the standard
/// library's `Float16`, an independent implementation of the same IEEE rounding.
final class HalfTests: XCTestCase {
    #if !(os(macOS) && arch(x86_64))
    func testEveryBitPatternWidensExactly() {
        for bits in 0...UInt16.max {
            let ours = Half.toFloat(bits), reference = Float(Float16(bitPattern: bits))
            XCTAssertTrue(ours.bitPattern == reference.bitPattern || (ours.isNaN && reference.isNaN), "fp16 0x\(String(bits, radix: 16))")
        }
    }

    func testRoundingIsToNearestEvenOnFp32Values() {
        var generator = SeededGenerator(seed: 3)
        var values: [Float] = [0, -0, 65504, 65519.996, 65520, -65520, .infinity, -.infinity,
                               Float(bitPattern: 0x3880_0000), Float(bitPattern: 0x387F_FFFF), Float(bitPattern: 0x3300_0000),
                               Float(bitPattern: 0x3300_0001), .leastNonzeroMagnitude]
        for index in 0..<400_000 {
            var bits = UInt32(truncatingIfNeeded: generator.next())
            // Half of them near fp16's range, where rounding decides something.
            if index % 2 == 0 { bits = (bits & 0x83FF_FFFF) | 0x3800_0000 }
            values.append(Float(bitPattern: bits))
        }
        for value in values where !value.isNaN {
            let reference = Float16(value)
            XCTAssertEqual(Half.fromFloat(value), reference.bitPattern, "\(value)")
            XCTAssertEqual(Half.round(value).bitPattern, Float(reference).bitPattern, "\(value)")
        }
        XCTAssertTrue(Half.round(.nan).isNaN)
        XCTAssertTrue(Half.toFloat(Half.fromFloat(.nan)).isNaN)
    }

    /// The vectorised paths (a tensor's fp16 storage widened, an fp32 result rounded to fp16)
    /// give what the scalar functions give.
    func testTensorConversionsUseTheSameRounding() {
        var generator = SeededGenerator(seed: 4)
        let values = (0..<10_000).map { _ in Float(bitPattern: (UInt32(truncatingIfNeeded: generator.next()) & 0x83FF_FFFF) | 0x3800_0000) }
        let rounded = Tensor.floats(values, shape: [values.count]).converted(to: .float16).floats()
        XCTAssertEqual(rounded.map(\.bitPattern), values.map { Float(Float16($0)).bitPattern })
    }
    #endif
}
