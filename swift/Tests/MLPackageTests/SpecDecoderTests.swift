import XCTest
import ProtoWire
import MLPackage
import TestSupport

final class SpecDecoderTests: XCTestCase {
    private let float16: Int64 = 65552  // ArrayDataType.FLOAT16
    private let int32: Int64 = 131104   // ArrayDataType.INT32
    private let float32: Int64 = 65568  // ArrayDataType.FLOAT32

    private func statefulDescription(unknown: [UInt8] = []) -> [UInt8] {
        let ids = SpecBytes.feature("inputIds", type: SpecBytes.multiArrayFeatureType(
            SpecBytes.arrayType(shape: [1, 8], dataType: int32, extra: SpecBytes.shapeRange([(1, 1), (1, -1)]) + unknown) + unknown),
            shortDescription: "token ids")
        let logits = SpecBytes.feature("logits", type: SpecBytes.multiArrayFeatureType(
            SpecBytes.arrayType(shape: [1, 8, 32], dataType: float16)))
        let cache = SpecBytes.feature("keyCache", type: SpecBytes.stateFeatureType(
            SpecBytes.arrayType(shape: [2, 1, 16, 4], dataType: float16)))
        let metadata = SpecBytes.metadata(author: "me", license: "MIT", shortDescription: "test model", version: "1.2",
                                          userDefined: [("a", "1"), ("b", "2"), ("a", "3")])
        return SpecBytes.message(1, ids) + unknown              // ModelDescription.input
            + SpecBytes.message(10, logits)                     // ModelDescription.output
            + SpecBytes.message(13, cache)                      // ModelDescription.state
            + SpecBytes.message(100, metadata + unknown)        // ModelDescription.metadata
    }

    func testDecodesHandEncodedStatefulModel() throws {
        let bytes = SpecBytes.model(version: 9, description: statefulDescription(),
                                    extra: SpecBytes.message(502, [0x08, 0x01]))  // Model.mlProgram
        let spec = try ModelSpecification(serializedBytes: bytes)

        XCTAssertEqual(spec.specificationVersion, 9)
        XCTAssertEqual(spec.modelTypeName, "mlProgram")
        let description = spec.description
        XCTAssertEqual(description.inputs, [FeatureDescription(
            name: "inputIds",
            type: .multiArray(MultiArrayType(shape: [1, 8], dataType: .int32,
                                             shapeRange: [SizeRange(lowerBound: 1, upperBound: 1),
                                                          SizeRange(lowerBound: 1, upperBound: -1)])),
            shortDescription: "token ids")])
        XCTAssertEqual(description.inputs.first?.type.multiArray?.shapeRange?.last?.isUnbounded, true)
        XCTAssertEqual(description.outputs, [FeatureDescription(
            name: "logits", type: .multiArray(MultiArrayType(shape: [1, 8, 32], dataType: .float16)))])
        XCTAssertEqual(description.states, [FeatureDescription(
            name: "keyCache", type: .state(MultiArrayType(shape: [2, 1, 16, 4], dataType: .float16)))])
        XCTAssertEqual(description.metadata, Metadata(shortDescription: "test model", versionString: "1.2",
                                                      author: "me", license: "MIT", userDefined: ["a": "3", "b": "2"]))
    }

    func testUnknownFieldsOfEveryWireTypeAreSkippedAtEveryLevel() throws {
        let plain = try ModelSpecification(serializedBytes: SpecBytes.model(version: 9, description: statefulDescription()))
        let noisy = try ModelSpecification(serializedBytes: SpecBytes.unknownFields + SpecBytes.model(
            version: 9, description: statefulDescription(unknown: SpecBytes.unknownFields), extra: SpecBytes.unknownFields))
        XCTAssertEqual(noisy, plain)
    }

    func testMultifunctionDescription() throws {
        func function(_ name: String, cacheLength: Int64) -> [UInt8] {
            SpecBytes.string(1, name)                                                        // FunctionDescription.name
                + SpecBytes.message(2, SpecBytes.feature("inputIds", type: SpecBytes.multiArrayFeatureType(
                    SpecBytes.arrayType(shape: [1, 1], dataType: int32))))                 // FunctionDescription.input
                + SpecBytes.message(3, SpecBytes.feature("logits", type: SpecBytes.multiArrayFeatureType(
                    SpecBytes.arrayType(shape: [1, 32], dataType: float32))))              // FunctionDescription.output
                + SpecBytes.message(6, SpecBytes.feature("keyCache", type: SpecBytes.stateFeatureType(
                    SpecBytes.arrayType(shape: [1, cacheLength], dataType: float16))))     // FunctionDescription.state
                + SpecBytes.string(4, "logits")                                              // FunctionDescription.predictedFeatureName
        }
        let description = SpecBytes.message(20, function("inject_kv", cacheLength: 64))     // ModelDescription.functions
            + SpecBytes.message(20, function("draft", cacheLength: 16))
            + SpecBytes.string(21, "draft")                                                  // ModelDescription.defaultFunctionName
        let spec = try ModelSpecification(serializedBytes: SpecBytes.model(version: 9, description: description))

        XCTAssertEqual(spec.description.functions.map(\.name), ["inject_kv", "draft"])
        XCTAssertEqual(spec.description.defaultFunctionName, "draft")
        let draft = try XCTUnwrap(spec.description.defaultFunction)
        XCTAssertEqual(draft.states.first?.type, .state(MultiArrayType(shape: [1, 16], dataType: .float16)))
        XCTAssertEqual(draft.outputs.first?.type.multiArray?.dataType, .float32)
        XCTAssertEqual(draft.predictedFeatureName, "logits")
        XCTAssertEqual(spec.description.function(named: "inject_kv")?.states.first?.type.multiArray?.shape, [1, 64])
        XCTAssertNil(spec.description.function(named: "verify"))
    }

    func testScalarFeatureKindsAndUnknownTypes() throws {
        let description = SpecBytes.message(1, SpecBytes.feature("count", type: SpecBytes.message(1, [])))  // FeatureType.int64Type
            + SpecBytes.message(1, SpecBytes.feature("score", type: SpecBytes.message(2, [])))              // FeatureType.doubleType
            + SpecBytes.message(1, SpecBytes.feature("label", type: SpecBytes.message(3, [])
                + SpecBytes.int(1000, 1)))                                                                  // FeatureType.stringType, isOptional
            + SpecBytes.message(1, SpecBytes.feature("picture", type: SpecBytes.message(4, [])))            // FeatureType.imageType
            + SpecBytes.message(1, SpecBytes.feature("future", type: SpecBytes.message(77, [0x08, 0x01])))
            + SpecBytes.message(1, SpecBytes.feature("untyped", type: []))
        let inputs = try ModelSpecification(serializedBytes: SpecBytes.model(version: 1, description: description)).description.inputs
        XCTAssertEqual(inputs.map(\.type), [.int64, .double, .string, .image, .unknown(fieldNumber: 77), .unknown(fieldNumber: nil)])
        XCTAssertEqual(inputs.map(\.isOptional), [false, false, true, false, false, false])
    }

    func testUnpackedShapeEnumeratedShapesAndUnrecognizedDataType() throws {
        let array = SpecBytes.arrayType(shape: [1, 3], dataType: 999_999, packedShape: false,
                                        extra: SpecBytes.enumeratedShapes([[1, 2], [1, 3], [1, 5]]))
        let description = SpecBytes.message(1, SpecBytes.feature("x", type: SpecBytes.multiArrayFeatureType(array)))
        let spec = try ModelSpecification(serializedBytes: SpecBytes.model(version: 9, description: description))
        XCTAssertEqual(spec.description.inputs.first?.type, .multiArray(MultiArrayType(
            shape: [1, 3], dataType: .unrecognized(999_999), enumeratedShapes: [[1, 2], [1, 3], [1, 5]])))
    }

    func testShapeFlexibilityIsAOneofLastWins() throws {
        let array = SpecBytes.arrayType(shape: [1, 3], dataType: int32,
                                        extra: SpecBytes.enumeratedShapes([[1, 2]]) + SpecBytes.shapeRange([(1, 1), (1, 4)]))
        let description = SpecBytes.message(1, SpecBytes.feature("x", type: SpecBytes.multiArrayFeatureType(array)))
        let type = try ModelSpecification(serializedBytes: SpecBytes.model(version: 9, description: description))
            .description.inputs.first?.type.multiArray
        XCTAssertNil(type?.enumeratedShapes)
        XCTAssertEqual(type?.shapeRange, [SizeRange(lowerBound: 1, upperBound: 1), SizeRange(lowerBound: 1, upperBound: 4)])
    }

    func testRepeatedSingularMessageFieldsMerge() throws {
        // Protobuf concatenation semantics: two description fields merge into one.
        let first = SpecBytes.message(1, SpecBytes.feature("a", type: SpecBytes.message(1, [])))
        let second = SpecBytes.message(10, SpecBytes.feature("b", type: SpecBytes.message(2, [])))
            + SpecBytes.message(100, SpecBytes.string(3, "author"))
        let bytes = SpecBytes.model(version: 9, description: first) + SpecBytes.message(2, second)
        let description = try ModelSpecification(serializedBytes: bytes).description
        XCTAssertEqual(description.inputs.map(\.name), ["a"])
        XCTAssertEqual(description.outputs.map(\.name), ["b"])
        XCTAssertEqual(description.metadata.author, "author")
    }

    func testEmptyBytesAreMissingSpecificationVersion() {
        XCTAssertThrowsError(try ModelSpecification(serializedBytes: [])) { error in
            XCTAssertEqual(error as? SpecDecodingError, .missingField("Model.specificationVersion"))
        }
    }

    func testMissingDescriptionIsRejected() {
        XCTAssertThrowsError(try ModelSpecification(serializedBytes: SpecBytes.int(1, 9))) { error in
            XCTAssertEqual(error as? SpecDecodingError, .missingField("Model.description"))
        }
    }

    func testWrongWireTypeForKnownFieldIsWireError() {
        // Model.description sent as a varint.
        XCTAssertThrowsError(try ModelSpecification(serializedBytes: SpecBytes.int(1, 9) + SpecBytes.int(2, 5))) { error in
            XCTAssertEqual(error as? SpecDecodingError, .wire(.unexpectedWireType(
                offset: 2, fieldNumber: 2, expected: .lengthDelimited, actual: .varint)))
        }
    }

    func testEveryTruncationThrowsTypedErrorOrDecodes() {
        let bytes = SpecBytes.model(version: 9, description: statefulDescription(unknown: SpecBytes.unknownFields))
        for length in 0..<bytes.count {
            do {
                _ = try ModelSpecification(serializedBytes: Array(bytes[0..<length]))
                XCTFail("prefix of \(length) bytes cuts the description and must not decode")
            } catch let error as SpecDecodingError {
                if case .wire(let wire) = error {
                    XCTAssertLessThanOrEqual(wire.offset, length)
                }
            } catch {
                XCTFail("unexpected error type \(error)")
            }
        }
    }

    func testRandomByteFlipsNeverTrap() {
        let valid = SpecBytes.model(version: 9, description: statefulDescription())
        var generator = FuzzGenerator(seed: 0x5EED)
        for _ in 0..<2000 {
            var bytes = valid
            for _ in 0...Int.random(in: 0..<3, using: &generator) {
                bytes[Int.random(in: 0..<bytes.count, using: &generator)] = UInt8.random(in: 0...255, using: &generator)
            }
            do {
                _ = try ModelSpecification(serializedBytes: bytes)
            } catch {
                XCTAssertTrue(error is SpecDecodingError, "unexpected error type \(error)")
            }
        }
    }
}
