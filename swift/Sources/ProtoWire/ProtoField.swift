/// The raw value of one field, shaped by its wire type.
public enum ProtoPayload: Sendable, Equatable {
    case varint(UInt64)
    case fixed64(UInt64)
    case fixed32(UInt32)
    case lengthDelimited(ProtoBuffer)
    /// The bytes between a start-group tag and its matching end-group tag.
    case group(ProtoBuffer)
}

/// One decoded field. The typed accessors interpret the payload the way a
/// schema says to and throw `unexpectedWireType` when the wire disagrees.
public struct ProtoField: Sendable, Equatable {
    public let fieldNumber: Int
    public let wireType: WireType
    /// Absolute offset of the field's tag.
    public let offset: Int
    public let payload: ProtoPayload

    public init(fieldNumber: Int, wireType: WireType, offset: Int, payload: ProtoPayload) {
        self.fieldNumber = fieldNumber
        self.wireType = wireType
        self.offset = offset
        self.payload = payload
    }

    // MARK: Varint-encoded scalars

    public func uint64() throws -> UInt64 {
        guard case .varint(let value) = payload else { throw mismatch(.varint) }
        return value
    }

    public func int64() throws -> Int64 {
        Int64(bitPattern: try uint64())
    }

    /// Protobuf parsers keep the low 32 bits of an int32 varint; negative
    /// int32 values are sign-extended to 10 bytes by every encoder.
    public func int32() throws -> Int32 {
        Int32(truncatingIfNeeded: try uint64())
    }

    public func uint32() throws -> UInt32 {
        UInt32(truncatingIfNeeded: try uint64())
    }

    public func bool() throws -> Bool {
        try uint64() != 0
    }

    public func sint64() throws -> Int64 {
        ZigZag.decode64(try uint64())
    }

    public func sint32() throws -> Int32 {
        ZigZag.decode32(UInt32(truncatingIfNeeded: try uint64()))
    }

    /// Proto3 open enums keep unknown values rather than rejecting them.
    public func enumRawValue() throws -> Int32 {
        try int32()
    }

    // MARK: Fixed-width scalars

    public func fixed32() throws -> UInt32 {
        guard case .fixed32(let value) = payload else { throw mismatch(.fixed32) }
        return value
    }

    public func fixed64() throws -> UInt64 {
        guard case .fixed64(let value) = payload else { throw mismatch(.fixed64) }
        return value
    }

    public func float() throws -> Float {
        Float(bitPattern: try fixed32())
    }

    public func double() throws -> Double {
        Double(bitPattern: try fixed64())
    }

    // MARK: Length-delimited

    public func lengthDelimited() throws -> ProtoBuffer {
        guard case .lengthDelimited(let buffer) = payload else { throw mismatch(.lengthDelimited) }
        return buffer
    }

    public func message() throws -> ProtoBuffer {
        try lengthDelimited()
    }

    public func bytes() throws -> [UInt8] {
        Array(try lengthDelimited().bytes)
    }

    public func string() throws -> String {
        let buffer = try lengthDelimited()
        guard let text = Self.decodeUTF8(buffer.bytes) else {
            throw ProtoWireError.invalidUTF8(offset: buffer.range.lowerBound, fieldNumber: fieldNumber)
        }
        return text
    }

    /// Proto3 packs repeated scalars by default, but parsers must accept the
    /// unpacked form too, so a single varint counts as a one-element list.
    public func packedVarints() throws -> [UInt64] {
        switch payload {
        case .varint(let value):
            return [value]
        case .lengthDelimited(let buffer):
            var reader = buffer.makeReader()
            var values: [UInt64] = []
            while !reader.isAtEnd {
                values.append(try reader.readVarint())
            }
            return values
        default:
            throw mismatch(.lengthDelimited)
        }
    }

    /// Packed fixed-width scalars (repeated float / fixed32 and double / fixed64), accepting the
    /// unpacked form (one value per field) too.
    public func packedFixed32() throws -> [UInt32] {
        switch payload {
        case .fixed32(let value):
            return [value]
        case .lengthDelimited(let buffer):
            var reader = buffer.makeReader()
            var values: [UInt32] = []
            values.reserveCapacity(buffer.count / 4)
            while !reader.isAtEnd {
                values.append(try reader.readFixed32())
            }
            return values
        default:
            throw mismatch(.lengthDelimited)
        }
    }

    public func packedFixed64() throws -> [UInt64] {
        switch payload {
        case .fixed64(let value):
            return [value]
        case .lengthDelimited(let buffer):
            var reader = buffer.makeReader()
            var values: [UInt64] = []
            values.reserveCapacity(buffer.count / 8)
            while !reader.isAtEnd {
                values.append(try reader.readFixed64())
            }
            return values
        default:
            throw mismatch(.lengthDelimited)
        }
    }

    // MARK: Internals

    private func mismatch(_ expected: WireType) -> ProtoWireError {
        .unexpectedWireType(offset: offset, fieldNumber: fieldNumber, expected: expected, actual: wireType)
    }

    private static func decodeUTF8(_ bytes: ArraySlice<UInt8>) -> String? {
        var decoder = UTF8()
        var iterator = bytes.makeIterator()
        while true {
            switch decoder.decode(&iterator) {
            case .scalarValue: continue
            case .emptyInput: return String(decoding: bytes, as: UTF8.self)
            case .error: return nil
            }
        }
    }
}
