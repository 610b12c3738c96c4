/// IEEE 754 binary16 conversions written out, not through `Float16`, which Swift does not offer
/// on every platform (macOS on Intel) and which converts through library calls here.
/// `toFloat` is exact; `fromFloat` and `round` round to nearest, ties to even, as numpy's
/// `astype(np.float16)` and Core ML's fp16 storage do. MuseflashRuntimeTests checks all three
/// against the standard library's `Float16` where it exists.
public enum Half {
    /// One fp16 value as fp32, exactly (see `widen`).
    @inline(__always)
    public static func toFloat(_ bits: UInt16) -> Float { widen(bits) }

    @inline(__always)
    public static func fromFloat(_ value: Float) -> UInt16 {
        let bits = value.bitPattern
        let sign = UInt16((bits >> 16) & 0x8000)
        let magnitude = bits & 0x7FFF_FFFF
        if magnitude >= 0x7F80_0000 {
            // inf stays inf; NaN keeps a quiet NaN payload.
            return sign | (magnitude > 0x7F80_0000 ? 0x7E00 : 0x7C00)
        }
        if magnitude >= 0x477F_F000 {
            // At or above 65520 (halfway past the largest finite fp16): inf.
            return sign | 0x7C00
        }
        if magnitude >= 0x3880_0000 {
            // Normal fp16: drop 13 mantissa bits, rounding to nearest even.
            let rebased = magnitude - 0x3800_0000  // exponent 127 -> 15
            let rounded = rebased + 0x0FFF + ((rebased >> 13) & 1)
            return sign | UInt16(truncatingIfNeeded: rounded >> 13)
        }
        if magnitude < 0x3300_0000 {
            // Below half the smallest subnormal (2^-25): zero.
            return sign
        }
        // Subnormal fp16: value / 2^-24, rounded to nearest even.
        let exponent = Int(magnitude >> 23)
        let significand = (magnitude & 0x7F_FFFF) | 0x80_0000
        let shift = 126 - exponent  // 14 ... 24 for 2^-25 <= |x| < 2^-14
        let half = UInt32(1) << UInt32(shift - 1)
        var result = significand >> UInt32(shift)
        let remainder = significand & ((UInt32(1) << UInt32(shift)) - 1)
        if remainder > half || (remainder == half && (result & 1) == 1) { result += 1 }
        return sign | UInt16(result)
    }

    /// The fp16 value nearest to `value`, as fp32 (see `roundFast`).
    @inline(__always)
    public static func round(_ value: Float) -> Float { roundFast(value) }

    /// `count` fp16 values from `source` as fp32 into `destination` (a plain loop over
    /// `widen`, which the compiler vectorizes).
    @inline(__always)
    static func widen(_ source: UnsafePointer<UInt16>, into destination: UnsafeMutablePointer<Float>, count: Int) {
        for index in 0..<count { destination[index] = widen(source[index]) }
    }

    /// One fp16 value as fp32, without a table: the magnitude's bits moved into fp32 position
    /// and scaled by 2^112 (which also normalises subnormals exactly), inf and NaN given the
    /// all-ones exponent, then the sign.
    @inline(__always)
    static func widen(_ half: UInt16) -> Float {
        let bits = UInt32(half)
        let magnitude = (bits & 0x7FFF) &<< 13
        var result = (Float(bitPattern: magnitude) * Float(bitPattern: 0x7780_0000)).bitPattern
        if bits & 0x7C00 == 0x7C00 { result = magnitude | 0x7F80_0000 }
        return Float(bitPattern: result | ((bits & 0x8000) &<< 16))
    }

    /// `value` rounded to the nearest fp16 (ties to even) and kept as fp32, without leaving
    /// fp32: 10 mantissa bits kept in the normal range, multiples of 2^-24 below it (an fp32
    /// addition at that spacing rounds them), inf from 65520 up: `toFloat(fromFloat(value))`
    /// without leaving fp32, branch-free enough to vectorize.
    @inline(__always)
    static func roundFast(_ value: Float) -> Float {
        let bits = value.bitPattern
        let sign = bits & 0x8000_0000
        let magnitude = bits & 0x7FFF_FFFF
        var result = (magnitude &+ 0x0FFF &+ ((magnitude &>> 13) & 1)) & 0xFFFF_E000
        if magnitude < 0x3880_0000 { result = (Float(bitPattern: magnitude) + 0.75 - 0.75).bitPattern }
        if magnitude >= 0x477F_F000 { result = magnitude > 0x7F80_0000 ? 0x7FC0_0000 : 0x7F80_0000 }
        return Float(bitPattern: result | sign)
    }

    /// Rounds every value to fp16 precision in place.
    static func roundInPlace(_ values: inout [Float]) {
        values.withUnsafeMutableBufferPointer { buffer in
            #if MILINTERPRETER_HASWELL
            // F16C's conversions there and back round to nearest even as `roundFast` does,
            // subnormals and infinities included; only a NaN keeps more payload than
            // `roundFast` keeps, so it is made the same quiet NaN.
            for index in buffer.indices {
                let value = buffer[index]
                let rounded = Float(Float16(value))
                buffer[index] = value.isNaN ? Float(bitPattern: 0x7FC0_0000 | (value.bitPattern & 0x8000_0000)) : rounded
            }
            #else
            for index in buffer.indices { buffer[index] = roundFast(buffer[index]) }
            #endif
        }
    }
}
