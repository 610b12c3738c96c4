/// The low three bits of a protobuf tag.
public enum WireType: UInt8, Sendable, CustomStringConvertible {
    case varint = 0
    case fixed64 = 1
    case lengthDelimited = 2
    /// Deprecated proto2 groups; still legal on the wire, so they must be skippable.
    case startGroup = 3
    case endGroup = 4
    case fixed32 = 5

    public var description: String {
        switch self {
        case .varint: return "varint"
        case .fixed64: return "fixed64"
        case .lengthDelimited: return "length-delimited"
        case .startGroup: return "start-group"
        case .endGroup: return "end-group"
        case .fixed32: return "fixed32"
        }
    }
}

/// Zigzag decoding for `sint32` / `sint64` fields, which map small negative
/// numbers to small unsigned ones so they stay short on the wire.
public enum ZigZag {
    public static func decode64(_ encoded: UInt64) -> Int64 {
        Int64(bitPattern: (encoded >> 1) ^ (0 &- (encoded & 1)))
    }

    public static func decode32(_ encoded: UInt32) -> Int32 {
        Int32(bitPattern: (encoded >> 1) ^ (0 &- (encoded & 1)))
    }
}
