/// A forward-only cursor over protobuf wire data. Every read checks bounds
/// before touching a byte and reports malformed input as `ProtoWireError`;
/// nothing here traps on hostile bytes.
public struct ProtoReader: Sendable {
    /// Groups are a proto2 relic; real Core ML specs never contain them, so a
    /// small limit only guards against inputs built to exhaust memory.
    public static let maximumGroupDepth = 64
    /// Field numbers are 29 bits wide (protobuf language guide).
    public static let maximumFieldNumber: UInt64 = (1 << 29) - 1

    private let storage: [UInt8]
    private let end: Int
    /// Absolute offset of the next unread byte.
    public private(set) var offset: Int

    public init(_ buffer: ProtoBuffer) {
        storage = buffer.storage
        offset = buffer.range.lowerBound
        end = buffer.range.upperBound
    }

    public init(_ bytes: [UInt8]) {
        self.init(ProtoBuffer(bytes))
    }

    public var isAtEnd: Bool { offset >= end }
    public var remaining: Int { end - offset }

    // MARK: Primitive reads

    public mutating func readVarint() throws -> UInt64 {
        let start = offset
        var index = offset
        var result: UInt64 = 0
        var shift: UInt64 = 0
        while true {
            guard index < end else { throw ProtoWireError.truncatedVarint(offset: start) }
            let byte = storage[index]
            index += 1
            // The 10th byte holds only bit 63; anything more cannot fit in 64 bits.
            if shift == 63 && byte > 1 {
                throw ProtoWireError.varintOverflow(offset: start)
            }
            result |= UInt64(byte & 0x7F) << shift
            if byte & 0x80 == 0 {
                offset = index
                return result
            }
            shift += 7
        }
    }

    public mutating func readFixed32() throws -> UInt32 {
        let start = try reserve(4)
        var value: UInt32 = 0
        for index in (start..<start + 4).reversed() {
            value = value << 8 | UInt32(storage[index])
        }
        return value
    }

    public mutating func readFixed64() throws -> UInt64 {
        let start = try reserve(8)
        var value: UInt64 = 0
        for index in (start..<start + 8).reversed() {
            value = value << 8 | UInt64(storage[index])
        }
        return value
    }

    public mutating func readLengthDelimited() throws -> ProtoBuffer {
        let length = try readVarint()
        let start = try reserve(length)
        return ProtoBuffer(storage: storage, range: start..<offset)
    }

    /// Returns the field number, wire type and the tag's own offset.
    public mutating func readTag() throws -> (fieldNumber: Int, wireType: WireType, offset: Int) {
        let tagOffset = offset
        let tag = try readVarint()
        let rawWireType = UInt8(tag & 0x7)
        guard let wireType = WireType(rawValue: rawWireType) else {
            throw ProtoWireError.invalidWireType(offset: tagOffset, rawValue: rawWireType)
        }
        let fieldNumber = tag >> 3
        guard fieldNumber >= 1, fieldNumber <= Self.maximumFieldNumber else {
            throw ProtoWireError.invalidFieldNumber(offset: tagOffset, fieldNumber: fieldNumber)
        }
        return (Int(fieldNumber), wireType, tagOffset)
    }

    // MARK: Fields

    /// The next field, or nil at the end of the buffer.
    public mutating func next() throws -> ProtoField? {
        guard !isAtEnd else { return nil }
        let (fieldNumber, wireType, tagOffset) = try readTag()
        let payload: ProtoPayload
        switch wireType {
        case .varint:
            payload = .varint(try readVarint())
        case .fixed64:
            payload = .fixed64(try readFixed64())
        case .fixed32:
            payload = .fixed32(try readFixed32())
        case .lengthDelimited:
            payload = .lengthDelimited(try readLengthDelimited())
        case .startGroup:
            payload = .group(try readGroupBody(fieldNumber: fieldNumber, tagOffset: tagOffset))
        case .endGroup:
            throw ProtoWireError.unexpectedEndGroup(offset: tagOffset, fieldNumber: fieldNumber)
        }
        return ProtoField(fieldNumber: fieldNumber, wireType: wireType, offset: tagOffset, payload: payload)
    }

    /// Advances past a value whose tag has already been read. Used for fields
    /// the caller's schema does not know, which are never an error.
    public mutating func skipValue(wireType: WireType, fieldNumber: Int, tagOffset: Int) throws {
        switch wireType {
        case .varint: _ = try readVarint()
        case .fixed64: _ = try reserve(8)
        case .fixed32: _ = try reserve(4)
        case .lengthDelimited: _ = try readLengthDelimited()
        case .startGroup: _ = try readGroupBody(fieldNumber: fieldNumber, tagOffset: tagOffset)
        case .endGroup:
            throw ProtoWireError.unexpectedEndGroup(offset: tagOffset, fieldNumber: fieldNumber)
        }
    }

    // MARK: Internals

    /// Claims `count` bytes and returns where they start.
    private mutating func reserve(_ count: UInt64) throws -> Int {
        let available = end - offset
        guard count <= UInt64(available) else {
            throw ProtoWireError.truncated(offset: offset, needed: count, available: available)
        }
        let start = offset
        offset += Int(count)
        return start
    }

    /// Scans to the end-group tag matching `fieldNumber` iteratively, so deep
    /// nesting costs a counter stack rather than call-stack frames.
    private mutating func readGroupBody(fieldNumber: Int, tagOffset: Int) throws -> ProtoBuffer {
        let bodyStart = offset
        var openGroups: [Int] = [fieldNumber]
        while let innermost = openGroups.last {
            guard !isAtEnd else {
                throw ProtoWireError.unterminatedGroup(offset: tagOffset, fieldNumber: fieldNumber)
            }
            let (number, wireType, offsetOfTag) = try readTag()
            switch wireType {
            case .startGroup:
                guard openGroups.count < Self.maximumGroupDepth else {
                    throw ProtoWireError.groupNestingTooDeep(offset: offsetOfTag)
                }
                openGroups.append(number)
            case .endGroup:
                guard number == innermost else {
                    throw ProtoWireError.unexpectedEndGroup(offset: offsetOfTag, fieldNumber: number)
                }
                openGroups.removeLast()
                if openGroups.isEmpty {
                    return ProtoBuffer(storage: storage, range: bodyStart..<offsetOfTag)
                }
            default:
                try skipValue(wireType: wireType, fieldNumber: number, tagOffset: offsetOfTag)
            }
        }
        // Unreachable: the stack starts non-empty and the loop returns when it empties.
        throw ProtoWireError.unterminatedGroup(offset: tagOffset, fieldNumber: fieldNumber)
    }
}
