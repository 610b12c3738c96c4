/// Every way a protobuf byte stream can be malformed. Offsets are absolute
/// positions in the buffer the decoding started from, so a report can point
/// at the exact byte of a file.
public enum ProtoWireError: Error, Equatable, Sendable, CustomStringConvertible {
    /// The buffer ended before a varint's final byte (one without the continuation bit).
    case truncatedVarint(offset: Int)
    /// A varint longer than 10 bytes, or whose 10th byte carries bits beyond 64.
    case varintOverflow(offset: Int)
    /// A fixed-width value or a length-delimited payload needs more bytes than remain.
    case truncated(offset: Int, needed: UInt64, available: Int)
    /// Wire types 6 and 7 are not defined by the protobuf encoding.
    case invalidWireType(offset: Int, rawValue: UInt8)
    /// Field number 0 or larger than 2^29 - 1.
    case invalidFieldNumber(offset: Int, fieldNumber: UInt64)
    /// An end-group tag without a matching start-group tag.
    case unexpectedEndGroup(offset: Int, fieldNumber: Int)
    /// A start-group tag whose matching end-group tag never arrives.
    case unterminatedGroup(offset: Int, fieldNumber: Int)
    /// Groups nested deeper than `ProtoReader.maximumGroupDepth`.
    case groupNestingTooDeep(offset: Int)
    /// A field arrived with a wire type its schema does not allow.
    case unexpectedWireType(offset: Int, fieldNumber: Int, expected: WireType, actual: WireType)
    /// A string field whose bytes are not valid UTF-8.
    case invalidUTF8(offset: Int, fieldNumber: Int)

    public var offset: Int {
        switch self {
        case .truncatedVarint(let offset),
             .varintOverflow(let offset),
             .truncated(let offset, _, _),
             .invalidWireType(let offset, _),
             .invalidFieldNumber(let offset, _),
             .unexpectedEndGroup(let offset, _),
             .unterminatedGroup(let offset, _),
             .groupNestingTooDeep(let offset),
             .unexpectedWireType(let offset, _, _, _),
             .invalidUTF8(let offset, _):
            return offset
        }
    }

    public var description: String {
        switch self {
        case .truncatedVarint(let offset):
            return "varint at byte \(offset) is cut off by the end of the data"
        case .varintOverflow(let offset):
            return "varint at byte \(offset) does not fit in 64 bits"
        case .truncated(let offset, let needed, let available):
            return "value at byte \(offset) needs \(needed) bytes but only \(available) remain"
        case .invalidWireType(let offset, let rawValue):
            return "tag at byte \(offset) has undefined wire type \(rawValue)"
        case .invalidFieldNumber(let offset, let fieldNumber):
            return "tag at byte \(offset) has invalid field number \(fieldNumber)"
        case .unexpectedEndGroup(let offset, let fieldNumber):
            return "end-group tag for field \(fieldNumber) at byte \(offset) has no matching start-group"
        case .unterminatedGroup(let offset, let fieldNumber):
            return "group for field \(fieldNumber) starting at byte \(offset) is never closed"
        case .groupNestingTooDeep(let offset):
            return "groups nest too deeply at byte \(offset)"
        case .unexpectedWireType(let offset, let fieldNumber, let expected, let actual):
            return "field \(fieldNumber) at byte \(offset) has wire type \(actual) but \(expected) was expected"
        case .invalidUTF8(let offset, let fieldNumber):
            return "string field \(fieldNumber) at byte \(offset) is not valid UTF-8"
        }
    }
}
