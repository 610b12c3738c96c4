import Foundation

/// Builds complete export directories (metadata.json plus .mlpackage bundles
/// with hand-encoded specs) so contract tests can break one thing at a time.
/// The metadata is kept as a plain JSON object, written independently of the
/// Codable model under test.
public struct SyntheticExport {
    public var metadata: [String: Any]
    /// Owner role -> package: a package several assets share (schema version 3) is under the
    /// first of their roles in pipeline order (`target`); `packageKey(role:)` finds any role's.
    public var packages: [String: PackageSpec]
    /// Other files (tokenizer files), path relative to the export directory -> contents.
    public var files: [String: Data]

    public init(metadata: [String: Any], packages: [String: PackageSpec], files: [String: Data] = [:]) {
        self.metadata = metadata
        self.packages = packages
        self.files = files
    }

    public func metadataText() throws -> String {
        let data = try JSONSerialization.data(withJSONObject: metadata, options: [.sortedKeys])
        return String(decoding: data, as: UTF8.self)
    }

    public func write(to directory: URL) throws {
        let fileManager = FileManager.default
        try fileManager.createDirectory(at: directory, withIntermediateDirectories: true)
        let text = try metadataText()
        try Data(text.utf8).write(to: directory.appendingPathComponent("metadata.json"))
        for package in packages.values {
            try package.write(to: directory.appendingPathComponent(package.path), metadataText: text)
        }
        for (path, contents) in files {
            let url = directory.appendingPathComponent(path)
            try fileManager.createDirectory(at: url.deletingLastPathComponent(), withIntermediateDirectories: true)
            try contents.write(to: url)
        }
    }

    /// Sets the value at a key path of nested objects, e.g. ["speculative_decoding", "block_size"].
    public mutating func setMetadata(_ keyPath: [String], to value: Any) {
        metadata = Self.setting(value, at: keyPath[...], in: metadata)
    }

    public mutating func removeMetadata(_ keyPath: [String]) {
        metadata = Self.setting(nil, at: keyPath[...], in: metadata)
    }

    private static func setting(_ value: Any?, at keyPath: ArraySlice<String>, in object: [String: Any]) -> [String: Any] {
        guard let key = keyPath.first else { return object }
        var copy = object
        if keyPath.count == 1 {
            copy[key] = value
        } else {
            copy[key] = setting(value, at: keyPath.dropFirst(), in: object[key] as? [String: Any] ?? [:])
        }
        return copy
    }

    /// The key in `packages` of the package `role`'s asset is stored in: `role` itself, or the
    /// key of the package whose path `assets.<role>.path` names.
    public func packageKey(role: String) -> String {
        if packages[role] != nil { return role }
        let path = ((metadata["assets"] as? [String: Any])?[role] as? [String: Any])?["path"] as? String
        guard let key = packages.first(where: { $0.value.path == path })?.key else {
            preconditionFailure("no package for \(role)")
        }
        return key
    }

    /// Edits function `name` of the package `role`'s asset is stored in.
    public mutating func editFunction(role: String, _ name: String, _ edit: (inout FunctionSpec) -> Void) {
        let key = packageKey(role: role)
        guard var package = packages[key], let index = package.functions.firstIndex(where: { $0.name == name }) else {
            preconditionFailure("no function \(name) in \(role)")
        }
        edit(&package.functions[index])
        packages[key] = package
    }
}

public struct TensorSpec {
    public var name: String
    public var shape: [Int64]
    public var dataType: Int64
    /// Encoded ArrayFeatureType.ShapeFlexibility, appended to the array type.
    public var flexibility: [UInt8]

    public init(_ name: String, _ shape: [Int64], _ dataType: Int64, flexibility: [UInt8] = []) {
        self.name = name
        self.shape = shape
        self.dataType = dataType
        self.flexibility = flexibility
    }

    // ArrayFeatureType.ArrayDataType values from FeatureTypes.proto.
    public static let float16: Int64 = 65552
    public static let float32: Int64 = 65568
    public static let int32: Int64 = 131104

    var arrayBytes: [UInt8] { SpecBytes.arrayType(shape: shape, dataType: dataType, extra: flexibility) }
    var featureBytes: [UInt8] { SpecBytes.feature(name, type: SpecBytes.multiArrayFeatureType(arrayBytes)) }
    var stateBytes: [UInt8] { SpecBytes.feature(name, type: SpecBytes.stateFeatureType(arrayBytes)) }
}

public struct FunctionSpec {
    public var name: String
    public var inputs: [TensorSpec]
    public var outputs: [TensorSpec]
    public var states: [TensorSpec]
    /// Names of the package's weights (`PackageSpec.weights`) this function's program uses;
    /// nil: all of them.
    public var weightNames: [String]?
    /// Weights this function stores as a plain fp16 const whatever their storage, with a blob
    /// of their own (damage: compressed in one function only).
    public var plainWeights: Set<String> = []
    /// Weight name -> the output name of its op in this function (default: the weight's name),
    /// as when two models merged into one package name different weights alike.
    public var opNames: [String: String] = [:]

    public init(name: String, inputs: [TensorSpec], outputs: [TensorSpec], states: [TensorSpec],
                weightNames: [String]? = nil) {
        self.name = name
        self.inputs = inputs
        self.outputs = outputs
        self.states = states
        self.weightNames = weightNames
    }

    var descriptionBytes: [UInt8] {
        SpecBytes.string(1, name)                                 // FunctionDescription.name
            + inputs.flatMap { SpecBytes.message(2, $0.featureBytes) }   // FunctionDescription.input
            + outputs.flatMap { SpecBytes.message(3, $0.featureBytes) }  // FunctionDescription.output
            + states.flatMap { SpecBytes.message(6, $0.stateBytes) }     // FunctionDescription.state
    }
}

public struct PackageSpec {
    /// Relative to the export directory.
    public var path: String
    public var functions: [FunctionSpec]
    /// False writes the only function's interface at the top level of the
    /// description, as coremltools does for a single-function program.
    public var isMultiFunction: Bool
    public var defaultFunction: String
    /// Nil embeds metadata.json's exact text.
    public var embeddedMetadata: String?
    /// The weights the ML program stores (as const or constexpr ops over blobs of weight.bin).
    /// Empty: the program has no functions and weight.bin is filler, never read.
    public var weights: [WeightSpec]
    /// A test's own ML program (the body of `Model.mlProgram`, `MILBytes.program`) in place of
    /// the one `weights` make.
    public var program: [UInt8]?
    /// `Model.specificationVersion`.
    public var specificationVersion: Int64 = 9

    public init(path: String, functions: [FunctionSpec], isMultiFunction: Bool, defaultFunction: String,
                embeddedMetadata: String? = nil, weights: [WeightSpec] = []) {
        self.path = path
        self.functions = functions
        self.isMultiFunction = isMultiFunction
        self.defaultFunction = defaultFunction
        self.embeddedMetadata = embeddedMetadata
        self.weights = weights
    }

    public static let modelPath = "Data/com.apple.CoreML/model.mlmodel"
    public static let weightPath = "Data/com.apple.CoreML/weights/weight.bin"

    public func modelBytes(metadataText: String) -> [UInt8] {
        let interface: [UInt8]
        if isMultiFunction {
            interface = functions.flatMap { SpecBytes.message(20, $0.descriptionBytes) }  // ModelDescription.functions
                + SpecBytes.string(21, defaultFunction)                                  // ModelDescription.defaultFunctionName
        } else {
            let only = functions.first ?? FunctionSpec(name: "main", inputs: [], outputs: [], states: [])
            interface = only.inputs.flatMap { SpecBytes.message(1, $0.featureBytes) }    // ModelDescription.input
                + only.outputs.flatMap { SpecBytes.message(10, $0.featureBytes) }        // ModelDescription.output
                + only.states.flatMap { SpecBytes.message(13, $0.stateBytes) }           // ModelDescription.state
        }
        let userDefined: [(String, String)] = [
            ("com.github.apple.coremltools.version", "9.0"),
            ("museflash.metadata", embeddedMetadata ?? metadataText),
        ]
        let metadata = SpecBytes.metadata(author: "museflash tests", license: "MIT",
                                          shortDescription: "synthetic \(path)", version: "0.0.0",
                                          userDefined: userDefined)
        let description = interface + SpecBytes.message(100, metadata)                   // ModelDescription.metadata
        return SpecBytes.model(version: specificationVersion, description: description,
                               extra: SpecBytes.message(502, (program ?? storage().program) + SpecBytes.unknownFields))  // Model.mlProgram
    }

    public func write(to packageURL: URL, metadataText: String) throws {
        let fileManager = FileManager.default
        let weightFile = packageURL.appendingPathComponent(Self.weightPath)
        try fileManager.createDirectory(at: weightFile.deletingLastPathComponent(), withIntermediateDirectories: true)
        try Data(modelBytes(metadataText: metadataText)).write(to: packageURL.appendingPathComponent(Self.modelPath))
        try Data(weights.isEmpty ? Array(repeating: 0xAB, count: 4096) : storage().weightFile).write(to: weightFile)
        let manifest: [String: Any] = [
            "fileFormatVersion": "1.0.0",
            "itemInfoEntries": [
                "6E1A9B9C-0000-4000-8000-000000000001": [
                    "author": "com.apple.CoreML", "description": "CoreML Model Specification",
                    "name": "model.mlmodel", "path": "com.apple.CoreML/model.mlmodel",
                ],
                "6E1A9B9C-0000-4000-8000-000000000002": [
                    "author": "com.apple.CoreML", "description": "CoreML Model Weights",
                    "name": "weights", "path": "com.apple.CoreML/weights",
                ],
            ],
            "rootModelIdentifier": "6E1A9B9C-0000-4000-8000-000000000001",
        ]
        let data = try JSONSerialization.data(withJSONObject: manifest, options: [.prettyPrinted, .sortedKeys])
        try data.write(to: packageURL.appendingPathComponent("Manifest.json"))
    }
}
