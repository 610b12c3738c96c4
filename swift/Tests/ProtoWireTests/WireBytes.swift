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
