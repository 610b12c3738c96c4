/// A window onto protobuf bytes. Nested messages share the storage of the
/// outermost buffer, so offsets in errors stay absolute to the original data
/// and decoding a nested message never copies it.
public struct ProtoBuffer: Sendable, Equatable {
    public let storage: [UInt8]
    public let range: Range<Int>

    public init(_ bytes: [UInt8]) {
        storage = bytes
        range = bytes.startIndex..<bytes.endIndex
    }

    /// Callers inside this module guarantee `range` lies within `storage`.
    init(storage: [UInt8], range: Range<Int>) {
        self.storage = storage
        self.range = range
    }

    public var count: Int { range.count }
    public var isEmpty: Bool { range.isEmpty }
    public var bytes: ArraySlice<UInt8> { storage[range] }

    public func makeReader() -> ProtoReader {
        ProtoReader(self)
    }

    /// Visits every top-level field in order, stopping at the first malformed byte.
    public func forEachField(_ body: (ProtoField) throws -> Void) throws {
        var reader = makeReader()
        while let field = try reader.next() {
            try body(field)
        }
    }

    public static func == (lhs: ProtoBuffer, rhs: ProtoBuffer) -> Bool {
        lhs.bytes == rhs.bytes
    }
}
