// A deliberately naive encoder, written separately from the decoder, so tests
// state expected bytes in terms of protobuf's rules rather than the code under test.
enum WireBytes {
    static func varint(_ value: UInt64) -> [UInt8] {
        var remaining = value
        var bytes: [UInt8] = []
        repeat {
            var byte = UInt8(remaining & 0x7F)
            remaining >>= 7
            if remaining != 0 { byte |= 0x80 }
            bytes.append(byte)
        } while remaining != 0
        return bytes
    }

    static func tag(_ fieldNumber: Int, _ wireType: UInt8) -> [UInt8] {
        varint(UInt64(fieldNumber) << 3 | UInt64(wireType))
    }

    static func varintField(_ fieldNumber: Int, _ value: UInt64) -> [UInt8] {
        tag(fieldNumber, 0) + varint(value)
    }

    static func fixed32Field(_ fieldNumber: Int, _ value: UInt32) -> [UInt8] {
        tag(fieldNumber, 5) + (0..<4).map { UInt8(truncatingIfNeeded: value >> (8 * $0)) }
    }

    static func fixed64Field(_ fieldNumber: Int, _ value: UInt64) -> [UInt8] {
        tag(fieldNumber, 1) + (0..<8).map { UInt8(truncatingIfNeeded: value >> (8 * UInt64($0))) }
    }

    static func lengthDelimitedField(_ fieldNumber: Int, _ payload: [UInt8]) -> [UInt8] {
        tag(fieldNumber, 2) + varint(UInt64(payload.count)) + payload
    }

    static func stringField(_ fieldNumber: Int, _ text: String) -> [UInt8] {
        lengthDelimitedField(fieldNumber, Array(text.utf8))
    }

    static func groupField(_ fieldNumber: Int, _ body: [UInt8]) -> [UInt8] {
        tag(fieldNumber, 3) + body + tag(fieldNumber, 4)
    }

    static func packedVarintField(_ fieldNumber: Int, _ values: [UInt64]) -> [UInt8] {
        lengthDelimitedField(fieldNumber, values.flatMap { varint($0) })
    }
}

/// Reproducible pseudo-random bytes (SplitMix64) so a fuzz failure replays exactly.
struct SeededGenerator: RandomNumberGenerator {
    var state: UInt64

    mutating func next() -> UInt64 {
        state &+= 0x9E37_79B9_7F4A_7C15
        var mixed = state
        mixed = (mixed ^ (mixed >> 30)) &* 0xBF58_476D_1CE4_E5B9
        mixed = (mixed ^ (mixed >> 27)) &* 0x94D0_49BB_1331_11EB
        return mixed ^ (mixed >> 31)
    }
}
