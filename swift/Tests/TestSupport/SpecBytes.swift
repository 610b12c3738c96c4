import Foundation

// Test-side protobuf encoder for hand-built Core ML specs. Field numbers are
// written out literally (checked against coremltools' Model_pb2 /
// FeatureTypes_pb2) rather than taken from the module under test.
public enum SpecBytes {
    public static func varint(_ value: UInt64) -> [UInt8] {
        var remaining = value
        var bytes: [UInt8] = []
        repeat {
            let low = UInt8(remaining & 0x7F)
            remaining >>= 7
            bytes.append(remaining == 0 ? low : low | 0x80)
        } while remaining != 0
        return bytes
    }

    public static func tag(_ field: Int, _ wireType: UInt8) -> [UInt8] {
        varint(UInt64(field) << 3 | UInt64(wireType))
    }

    public static func int(_ field: Int, _ value: Int64) -> [UInt8] {
        tag(field, 0) + varint(UInt64(bitPattern: value))
    }

    public static func message(_ field: Int, _ body: [UInt8]) -> [UInt8] {
        tag(field, 2) + varint(UInt64(body.count)) + body
    }

    public static func string(_ field: Int, _ text: String) -> [UInt8] {
        message(field, Array(text.utf8))
    }

    public static func packed(_ field: Int, _ values: [Int64]) -> [UInt8] {
        message(field, values.flatMap { varint(UInt64(bitPattern: $0)) })
    }

    /// One of every wire type under field numbers no Core ML message uses.
    public static let unknownFields: [UInt8] =
        int(9_999, 12345)
        + tag(9_998, 1) + [1, 2, 3, 4, 5, 6, 7, 8]
        + string(9_997, "ignored")
        + tag(9_996, 5) + [1, 2, 3, 4]
        + tag(9_995, 3) + int(1, 1) + string(2, "inside group") + tag(9_995, 4)

    // MARK: Core ML messages

    public static func arrayType(shape: [Int64], dataType: Int64, packedShape: Bool = true, extra: [UInt8] = []) -> [UInt8] {
        let shapeBytes = packedShape
            ? packed(1, shape)                                   // ArrayFeatureType.shape
            : shape.flatMap { int(1, $0) }
        return shapeBytes + int(2, dataType) + extra              // ArrayFeatureType.dataType
    }

    public static func shapeRange(_ ranges: [(UInt64, Int64)]) -> [UInt8] {
        message(31, ranges.flatMap { range in                     // ArrayFeatureType.shapeRange
            message(1, int(1, Int64(bitPattern: range.0)) + int(2, range.1))  // ShapeRange.sizeRanges: SizeRange.lowerBound, upperBound
        })
    }

    public static func enumeratedShapes(_ shapes: [[Int64]]) -> [UInt8] {
        message(21, shapes.flatMap { message(1, packed(1, $0)) }) // ArrayFeatureType.enumeratedShapes -> shapes -> Shape.shape
    }

    public static func multiArrayFeatureType(_ array: [UInt8]) -> [UInt8] {
        message(5, array)                                         // FeatureType.multiArrayType
    }

    public static func stateFeatureType(_ array: [UInt8]) -> [UInt8] {
        message(8, message(1, array))                             // FeatureType.stateType -> StateFeatureType.arrayType
    }

    public static func feature(_ name: String, type: [UInt8], shortDescription: String? = nil) -> [UInt8] {
        string(1, name)                                           // FeatureDescription.name
            + (shortDescription.map { string(2, $0) } ?? [])      // FeatureDescription.shortDescription
            + message(3, type)                                    // FeatureDescription.type
    }

    public static func metadata(author: String, license: String, shortDescription: String, version: String,
                         userDefined: [(String, String)]) -> [UInt8] {
        string(1, shortDescription) + string(2, version) + string(3, author) + string(4, license)
            + userDefined.flatMap { message(100, string(1, $0.0) + string(2, $0.1)) }  // Metadata.userDefined entries
    }

    public static func model(version: Int64, description: [UInt8], extra: [UInt8] = []) -> [UInt8] {
        int(1, version)                                           // Model.specificationVersion
            + message(2, description)                             // Model.description
            + extra
    }
}
