import XCTest
import Foundation
import ExportMetadata

/// The Swift reader against the golden examples the Python side writes in the same build
/// (//python:metadata_examples, from python/museflash/bundle.py), so a field renamed, retyped or
/// dropped on either side fails here. MUSEFLASH_METADATA_EXAMPLES names the file; missing it is a
/// failure, not a skip. SwiftPM: `bazel build //python:metadata_examples`, then
/// `MUSEFLASH_METADATA_EXAMPLES=$PWD/../bazel-bin/python/metadata_examples.json swift test --filter MetadataExamplesTests`.
final class MetadataExamplesTests: XCTestCase {
    struct Examples: Decodable {
        var supportedSchemaVersions: [Int]
        /// Every closed set of contract names on the Python side: class name -> spellings.
        var names: [String: [String]]
        var files: Files
        var valid: [Example]
        var forwardCompatible: [Example]
        var invalid: [Example]

        enum CodingKeys: String, CodingKey {
            case supportedSchemaVersions = "supported_schema_versions"
            case names
            case files
            case valid
            case forwardCompatible = "forward_compatible"
            case invalid
        }
    }

    /// The bundle's fixed names on the Python side (bundle.py).
    struct Files: Decodable {
        var metadataFile: String
        var embeddedMetadataKey: String
        var tokenizerFile: String
        var tokenizerFiles: [String]

        enum CodingKeys: String, CodingKey {
            case metadataFile = "metadata_file"
            case embeddedMetadataKey = "embedded_metadata_key"
            case tokenizerFile = "tokenizer_file"
            case tokenizerFiles = "tokenizer_files"
        }
    }

    struct Example: Decodable {
        var name: String
        var metadata: JSONValue
        /// forward_compatible: the valid example this one extends.
        var base: String?
        /// invalid: why a reader must reject it.
        var reason: String?
    }

    private struct ExamplesUnavailable: Error, CustomStringConvertible {
        var description: String
    }

    private func examples() throws -> Examples {
        let variable = "MUSEFLASH_METADATA_EXAMPLES"
        guard let path = ProcessInfo.processInfo.environment[variable], !path.isEmpty else {
            throw ExamplesUnavailable(description: "\(variable) is required: set it to the metadata_examples.json "
                                      + "that //python:metadata_examples builds")
        }
        let url = path.hasPrefix("/") ? URL(fileURLWithPath: path)
            : URL(fileURLWithPath: FileManager.default.currentDirectoryPath).appendingPathComponent(path)
        let examples = try JSONDecoder().decode(Examples.self, from: Data(contentsOf: url))
        for (list, entries) in [("valid", examples.valid), ("forward_compatible", examples.forwardCompatible),
                                ("invalid", examples.invalid)] where entries.isEmpty {
            throw ExamplesUnavailable(description: "\(path) has no \(list) examples")
        }
        return examples
    }

    /// The example as the bytes a reader would get from metadata.json.
    private func text(of example: Example) throws -> Data {
        try JSONEncoder().encode(example.metadata)
    }

    /// Swift leaves nil optionals out where Python writes null; both mean the same.
    private func withoutNulls(_ value: JSONValue) -> JSONValue {
        switch value {
        case .object(let members): return .object(members.filter { $0.value != .null }.mapValues(withoutNulls))
        case .array(let values): return .array(values.map(withoutNulls))
        default: return value
        }
    }

    func testSupportedSchemaVersionsAgree() throws {
        XCTAssertEqual(try examples().supportedSchemaVersions, ExportMetadata.supportedSchemaVersions)
    }

    /// BundleContract, every Swift module's file names and embedded metadata key, says what
    /// bundle.py says.
    func testBundleFileNamesAgreeWithPython() throws {
        let python = try examples().files
        XCTAssertEqual(BundleContract.metadataFileName, python.metadataFile)
        XCTAssertEqual(BundleContract.embeddedMetadataKey, python.embeddedMetadataKey)
        XCTAssertEqual(BundleContract.tokenizerFileName, python.tokenizerFile)
        XCTAssertEqual(BundleContract.tokenizerFileNames, python.tokenizerFiles)
    }

    /// Each Swift enum of contract names has exactly the spellings of its Python namesake
    /// (python/museflash/bundle.py), and every Python set has a Swift enum: a name added,
    /// removed or respelled on one side fails here.
    func testContractNameSetsAgreeWithPython() throws {
        let python = try examples().names
        var compared: Set<String> = []
        func compare<Name: ContractName>(_: Name.Type, as pythonName: String) {
            compared.insert(pythonName)
            guard let spellings = python[pythonName] else {
                return XCTFail("Python has no contract name set \(pythonName) (it has \(python.keys.sorted()))")
            }
            XCTAssertEqual(Set(Name.allCases.map(\.rawValue)), Set(spellings),
                           "\(pythonName): first Swift's, second Python's")
        }
        typealias M = ExportMetadata
        compare(M.AssetRole.self, as: "AssetRole")
        compare(M.AssetKind.self, as: "AssetKind")
        compare(M.FunctionName.self, as: "FunctionName")
        compare(M.FunctionRole.self, as: "FunctionRole")
        compare(M.InputName.self, as: "InputName")
        compare(M.OutputName.self, as: "OutputName")
        compare(M.StateName.self, as: "StateName")
        compare(M.StateKind.self, as: "StateKind")
        compare(M.StateRole.self, as: "StateRole")
        compare(M.DrafterKind.self, as: "DrafterKind")
        compare(M.SelectorDecoding.self, as: "SelectorDecoding")
        compare(M.LayerType.self, as: "LayerType")
        compare(M.NormForm.self, as: "NormForm")
        compare(M.KVWrite.self, as: "KVWrite")
        compare(M.CompressionMode.self, as: "CompressionMode")
        compare(M.CompressionPreset.self, as: "CompressionPreset")
        XCTAssertEqual(Set(python.keys).subtracting(compared), [],
                       "Python contract name sets with no Swift enum compared here")
    }

    /// Every valid example decodes, and encoding it again gives the same JSON: every field the
    /// exporter writes is read under the same name, with nothing left over.
    func testValidExamplesDecodeAndRoundTrip() throws {
        for example in try examples().valid {
            let metadata: ExportMetadata
            do {
                metadata = try ExportMetadata.decode(from: try text(of: example), path: example.name)
            } catch {
                XCTFail("valid example \(example.name) does not decode: \(error)")
                continue
            }
            XCTAssertTrue(metadata.isSchemaVersionSupported, "valid example \(example.name)")
            let encoded = try JSONDecoder().decode(JSONValue.self, from: try JSONEncoder().encode(metadata))
            let (expected, actual) = (withoutNulls(example.metadata), withoutNulls(encoded))
            XCTAssertEqual(actual, expected, "valid example \(example.name) does not round-trip "
                           + "(first: example, second: Swift): " + expected.differences(from: actual).joined(separator: "; "))
        }
    }

    /// The package rules as this reader applies them (schema version 3): each asset's default
    /// function is one of its functions; assets sharing a package list distinct functions and
    /// states; `compression.groups[i].packages` names only package owners; the drafter kind
    /// leads to the asset the exporter wrote; a state's kind and role follow from its name.
    func testValidExamplesFollowThePackageRules() throws {
        for example in try examples().valid {
            guard let metadata = try? ExportMetadata.decode(from: try text(of: example), path: example.name) else {
                continue  // testValidExamplesDecodeAndRoundTrip reports it
            }
            for (role, asset) in metadata.assets {
                XCTAssertNotNil(asset.functions[asset.defaultFunction],
                                "\(example.name): \(role) default_function \(asset.defaultFunction) is not one of its functions")
            }
            for package in metadata.packages where package.isShared {
                let assets = package.roles.compactMap { metadata.assets[$0] }
                let functions = assets.flatMap(\.functions.keys)
                XCTAssertEqual(Set(functions).count, functions.count, "\(example.name): \(package.path) functions \(functions)")
                let states = assets.flatMap { $0.states.map(\.name) }
                XCTAssertEqual(Set(states).count, states.count, "\(example.name): \(package.path) states \(states)")
            }
            if let speculative = metadata.speculativeDecoding {
                XCTAssertNotNil(metadata.assets[speculative.drafterKind.assetRole],
                                "\(example.name): drafter kind \(speculative.drafterKind) has no \(speculative.drafterKind.assetRole) asset")
            }
            let owners = Set(metadata.packages.map(\.owner))
            for (index, group) in (metadata.compression?.groups ?? []).enumerated() {
                XCTAssertTrue(Set(group.packages.keys).isSubset(of: owners),
                              "\(example.name): compression.groups[\(index)].packages \(group.packages.keys) are not all owners \(owners)")
            }
            XCTAssertEqual(metadata.assets[.target]?.states.map(\.name),
                           ExportMetadata.targetStateNames(layerTypes: metadata.target.layerTypes),
                           "\(example.name): the target's states are the pair of each layer kind it has")
            for asset in metadata.assets.values {
                for state in asset.states {
                    XCTAssertEqual(state.kind, state.name.kind, "\(example.name): state \(state.name)")
                    XCTAssertEqual(state.role, state.name.role, "\(example.name): state \(state.name)")
                }
            }
        }
    }

    /// A target of full-attention layers only (the tiny Qwen3 pair) has the global pair alone.
    func testTheGlobalOnlyTargetExampleHasOnlyTheGlobalPair() throws {
        let example = try XCTUnwrap(try examples().valid.first { $0.name == "dflash_global_only_target" })
        let metadata = try ExportMetadata.decode(from: try text(of: example), path: example.name)
        XCTAssertEqual(Set(metadata.target.layerTypes), [.fullAttention])
        XCTAssertEqual(metadata.target.slidingWindow, 0)
        XCTAssertEqual(metadata.assets[.target]?.states.map(\.name), [.globalKeyCache, .globalValueCache])
    }

    /// Keys a reader does not know are ignored at every level.
    func testForwardCompatibleExamplesDecodeLikeTheirBase() throws {
        let examples = try examples()
        for example in examples.forwardCompatible {
            guard let baseName = example.base, let base = examples.valid.first(where: { $0.name == baseName }) else {
                XCTFail("forward_compatible example \(example.name) names no valid base (\(example.base ?? "none"))")
                continue
            }
            XCTAssertNotEqual(example.metadata, base.metadata, "forward_compatible example \(example.name) adds nothing")
            do {
                let decoded = try ExportMetadata.decode(from: try text(of: example), path: example.name)
                let decodedBase = try ExportMetadata.decode(from: try text(of: base), path: baseName)
                if decoded != decodedBase {
                    let json = { (metadata: ExportMetadata) in
                        try JSONDecoder().decode(JSONValue.self, from: try JSONEncoder().encode(metadata))
                    }
                    XCTFail("forward_compatible example \(example.name) decodes unlike \(baseName) (first: base): "
                            + (try json(decodedBase)).differences(from: try json(decoded)).joined(separator: "; "))
                }
            } catch {
                XCTFail("forward_compatible example \(example.name) or its base does not decode: \(error)")
            }
        }
    }

    /// Every invalid example fails to decode or declares a schema version this reader rejects.
    func testInvalidExamplesAreRejected() throws {
        for example in try examples().invalid {
            let reason = example.reason ?? "no reason given"
            do {
                let metadata = try ExportMetadata.decode(from: try text(of: example), path: example.name)
                XCTAssertFalse(metadata.isSchemaVersionSupported,
                               "invalid example \(example.name) was accepted; it must not be because: \(reason)")
            } catch let error as ExportMetadataError {
                print("invalid example \(example.name) (\(reason)) rejected: \(error)")
            }
        }
    }
}
