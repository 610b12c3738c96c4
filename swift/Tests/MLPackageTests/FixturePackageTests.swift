import XCTest
import Foundation
import MLPackage

/// Opens the coremltools-made fixtures and checks them against the values
/// make_fixtures.py set and against expected.json, which that script derives
/// with coremltools' own protobuf parser.
final class FixturePackageTests: XCTestCase {
    private let fixtureNames = ["Ranged.mlpackage", "Enumerated.mlpackage", "Stateful.mlpackage", "MultiFunction.mlpackage"]

    private func open(_ name: String) throws -> MLPackage {
        try MLPackage.open(at: FixtureLocator.url(name))
    }

    // MARK: Independent comparison with expected.json

    private func json(_ array: MultiArrayType, kind: String) -> [String: Any] {
        var result: [String: Any] = [
            "kind": kind,
            "shape": array.shape.map { Int($0) },
            "dataType": array.dataType.description,
        ]
        if let ranges = array.shapeRange {
            result["shapeRange"] = ranges.map { [Int($0.lowerBound), Int($0.upperBound)] }
        }
        if let shapes = array.enumeratedShapes {
            result["enumeratedShapes"] = shapes.map { $0.map { Int($0) } }
        }
        return result
    }

    private func json(_ type: FeatureType) -> [String: Any] {
        switch type {
        case .multiArray(let array): return json(array, kind: "multiArray")
        case .state(let array): return json(array ?? MultiArrayType(), kind: "state")
        case .int64: return ["kind": "int64"]
        case .double: return ["kind": "double"]
        case .string: return ["kind": "string"]
        default: return ["kind": "unknown"]
        }
    }

    private func json(_ features: [FeatureDescription]) -> [[String: Any]] {
        features.map { ["name": $0.name, "type": json($0.type)] }
    }

    private func json(_ package: MLPackage) -> [String: Any] {
        let description = package.description
        let metadata = description.metadata
        return [
            "specificationVersion": package.specificationVersion,
            "inputs": json(description.inputs),
            "outputs": json(description.outputs),
            "states": json(description.states),
            "functions": description.functions.map { function -> [String: Any] in
                ["name": function.name, "inputs": json(function.inputs),
                 "outputs": json(function.outputs), "states": json(function.states)]
            },
            "defaultFunctionName": description.defaultFunctionName,
            "metadata": [
                "shortDescription": metadata.shortDescription,
                "versionString": metadata.versionString,
                "author": metadata.author,
                "license": metadata.license,
                "userDefined": metadata.userDefined,
            ] as [String: Any],
        ]
    }

    private func canonicalJSON(_ value: Any) throws -> String {
        let data = try JSONSerialization.data(withJSONObject: value, options: [.sortedKeys, .prettyPrinted])
        return String(decoding: data, as: UTF8.self)
    }

    func testEveryFixtureMatchesExpectedJSON() throws {
        let data = try Data(contentsOf: FixtureLocator.url("expected.json"))
        let expected = try XCTUnwrap(JSONSerialization.jsonObject(with: data) as? [String: Any])
        XCTAssertEqual(Set(expected.keys), Set(fixtureNames))
        for name in fixtureNames {
            let decoded = try canonicalJSON(json(try open(name)))
            let reference = try canonicalJSON(try XCTUnwrap(expected[name]))
            XCTAssertEqual(decoded, reference, "\(name) differs from coremltools' reading")
        }
    }

    // MARK: Values the generator set

    func testMetadataSetByGenerator() throws {
        for (name, tag) in [("Ranged.mlpackage", "ranged"), ("Stateful.mlpackage", "stateful"),
                            ("MultiFunction.mlpackage", "multifunction")] {
            let package = try open(name)
            let metadata = package.description.metadata
            XCTAssertEqual(metadata.author, "museflash fixtures")
            XCTAssertEqual(metadata.license, "MIT")
            XCTAssertEqual(metadata.versionString, "0.1.0")
            XCTAssertEqual(metadata.shortDescription, "\(tag) fixture for the Swift MLPackage reader")
            XCTAssertEqual(package.userDefinedMetadata["museflash.fixture"], tag)
            XCTAssertEqual(package.userDefinedMetadata["museflash.cacheLength"], "4")
            XCTAssertNil(package.userDefinedMetadata["com.github.apple.coremltools.conversion_date"])
        }
    }

    func testRangedInput() throws {
        let package = try open("Ranged.mlpackage")
        XCTAssertEqual(package.specificationVersion, 9)
        XCTAssertEqual(package.specification.modelTypeName, "mlProgram")
        XCTAssertFalse(package.isMultiFunction)
        let input = try XCTUnwrap(package.description.inputs.first)
        XCTAssertEqual(input.name, "inputIds")
        XCTAssertEqual(input.type, .multiArray(MultiArrayType(
            shape: [1, 3], dataType: .int32,
            shapeRange: [SizeRange(lowerBound: 1, upperBound: 1), SizeRange(lowerBound: 1, upperBound: 8)])))
        XCTAssertEqual(package.description.outputs.map(\.name), ["logits"])
    }

    func testEnumeratedInput() throws {
        let input = try XCTUnwrap(try open("Enumerated.mlpackage").description.inputs.first)
        XCTAssertEqual(input.type.multiArray?.enumeratedShapes.map(Set.init), Set([[1, 2], [1, 3], [1, 5]]))
        XCTAssertNil(input.type.multiArray?.shapeRange)
    }

    func testStatefulPackage() throws {
        let package = try open("Stateful.mlpackage")
        XCTAssertEqual(package.description.inputs.map(\.name), ["inputIds", "position"])
        XCTAssertEqual(package.description.inputs.map { $0.type.multiArray?.dataType }, [.int32, .int32])
        XCTAssertEqual(package.description.states, [FeatureDescription(
            name: "keyCache", type: .state(MultiArrayType(shape: [1, 4, 4], dataType: .float16)))])
        XCTAssertEqual(package.description.outputs.first?.type,
                       .multiArray(MultiArrayType(shape: [1, 4], dataType: .float16)))
    }

    func testMultiFunctionPackage() throws {
        let package = try open("MultiFunction.mlpackage")
        XCTAssertTrue(package.isMultiFunction)
        XCTAssertEqual(package.functions.map(\.name), ["inject_kv", "draft"])
        XCTAssertEqual(package.description.defaultFunctionName, "draft")
        XCTAssertEqual(package.description.defaultFunction?.name, "draft")
        for function in package.functions {
            XCTAssertEqual(function.inputs.map(\.name), ["inputIds", "position"])
            XCTAssertEqual(function.states.first?.type, .state(MultiArrayType(shape: [1, 4, 4], dataType: .float16)))
        }
        XCTAssertTrue(package.description.inputs.isEmpty)
    }

    func testManifestIsParsed() throws {
        let package = try open("Stateful.mlpackage")
        XCTAssertEqual(package.manifest.fileFormatVersion, "1.0.0")
        XCTAssertEqual(package.manifest.rootItem?.path, "com.apple.CoreML/model.mlmodel")
        XCTAssertEqual(package.manifest.rootItem?.name, "model.mlmodel")
        XCTAssertEqual(package.manifest.items.count, 2)
        XCTAssertEqual(package.modelURL.lastPathComponent, "model.mlmodel")
    }

    func testOpeningNeverNeedsTheWeights() throws {
        // If the reader touched weights/weight.bin, removing it would break opening.
        let copy = try FixtureLocator.temporaryCopy(of: "Stateful.mlpackage")
        defer { FixtureLocator.removeTemporaryCopy(copy) }
        let original = try open("Stateful.mlpackage")
        try FileManager.default.removeItem(at: copy.appendingPathComponent("Data/com.apple.CoreML/weights"))
        XCTAssertEqual(try MLPackage.open(at: copy).specification, original.specification)
    }
}
