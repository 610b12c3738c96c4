import Foundation
import MILInterpreter

/// A handle to state buffers; only `MLModel.makeState()` makes one.
@available(macOS 15.0, iOS 18.0, *)
public final class MLState: @unchecked Sendable {
    let store: StateStore

    init(store: StateStore) { self.store = store }

    /// A mutable view of one state buffer (fp16), valid inside `body` only: copied into a new
    /// array, and back from it by its strides when `body` returns.
    @available(macOS 15.0, iOS 18.0, *)
    public func withMultiArray<R>(for stateName: String, _ body: (MLMultiArray) throws -> R) rethrows -> R {
        guard let tensor = store.values[stateName] else {
            preconditionFailure("MLState has no state named \(stateName)")
        }
        let array = try! MLMultiArray(shape: tensor.shape.map { NSNumber(value: $0) }, dataType: .float16)
        let values = tensor.floats()
        array.withUnsafeMutableBytes { bytes, strides in
            forEachOffset(shape: tensor.shape, strides: strides) { index, offset in
                bytes.storeBytes(of: Half.fromFloat(values[index]), toByteOffset: offset * 2, as: UInt16.self)
            }
        }
        let result = try body(array)
        let offsets = array.byteOffsets()
        let written: [Float] = array.withUnsafeBytes { bytes in
            offsets.map { Half.toFloat(bytes.loadUnaligned(fromByteOffset: $0, as: UInt16.self)) }
        }
        store.values[stateName] = .floats(written, shape: tensor.shape, type: .float16)
        return result
    }
}

/// One function of a compiled model (Core ML: one MLModel instance per function).
@available(macOS 10.13, iOS 11.0, *)
public final class MLModel: @unchecked Sendable {
    private static let lock = NSLock()
    private static var programs: [String: PackageProgram] = [:]

    /// What `compileModel(at:)` writes into an `.mlmodelc`: the package as the interpreter reads
    /// it, and a marker naming the writer.
    static let compiledPackageName = "model.mlpackage"
    static let markerName = "coremldata.bin"
    static let marker = Data("museflash CoreMLStandIn compiled model 1\n".utf8)

    private let function: CompiledFunction
    @available(macOS 10.13, iOS 11.0, *)
    public let modelDescription: MLModelDescription

    /// Writes a compiled model to a new temporary location and returns its URL (move it to keep
    /// it, as Apple says). Here: a copy of the package, symlinks followed, plus a marker.
    @available(macOS 10.13, iOS 11.0, *)
    public class func compileModel(at modelURL: URL) throws -> URL {
        guard FileManager.default.fileExists(atPath: modelURL.path) else {
            throw MLStandInError("no model at \(modelURL.path)")
        }
        guard modelURL.pathExtension == "mlpackage" else {
            throw MLStandInError("\(modelURL.path) is not an .mlpackage; the stand-in compiles packages only")
        }
        let directory = FileManager.default.temporaryDirectory
            .appendingPathComponent("museflash-standin-\(UUID().uuidString)", isDirectory: true)
        let compiled = directory.appendingPathComponent(modelURL.deletingPathExtension().lastPathComponent + ".mlmodelc")
        try copyResolvingLinks(modelURL, to: compiled.appendingPathComponent(compiledPackageName))
        try marker.write(to: compiled.appendingPathComponent(markerName))
        return compiled
    }

    @available(macOS 10.14, iOS 12.0, *)
    public convenience init(contentsOf url: URL, configuration: MLModelConfiguration) throws {
        let fileManager = FileManager.default
        if url.pathExtension == "mlpackage" || fileManager.fileExists(atPath: url.appendingPathComponent("Manifest.json").path) {
            throw MLStandInError("\(url.path) is not a compiled model; compile it with MLModel.compileModel(at:) and load the .mlmodelc")
        }
        guard fileManager.contents(atPath: url.appendingPathComponent(Self.markerName).path) == Self.marker else {
            throw MLStandInError("\(url.path) is not a compiled model the stand-in wrote (it loads only what its compileModel(at:) writes)")
        }
        let key = url.standardizedFileURL.path
        let program: PackageProgram = try Self.lock.withLock {
            if let existing = Self.programs[key] { return existing }
            let opened = try PackageProgram(packageURL: url.appendingPathComponent(Self.compiledPackageName))
            Self.programs[key] = opened
            return opened
        }
        let name = configuration.functionName ?? program.package.description.defaultFunctionName
        self.init(function: try program.function(named: name.isEmpty ? "main" : name),
                  userDefined: program.package.userDefinedMetadata)
    }

    private init(function: CompiledFunction, userDefined: [String: String]) {
        self.function = function
        modelDescription = MLModelDescription(function: function, userDefined: userDefined)
    }

    /// Zero-filled buffers of every state the function declares (documented).
    @available(macOS 15.0, iOS 18.0, *)
    public func makeState() -> MLState {
        MLState(store: StateStore(specs: function.states))
    }

    @available(macOS 15.0, iOS 18.0, *)
    public func prediction(from inputFeatures: any MLFeatureProvider, using state: MLState) throws -> any MLFeatureProvider {
        try prediction(from: inputFeatures, using: state, options: MLPredictionOptions())
    }

    @available(macOS 15.0, iOS 18.0, *)
    public func prediction(from inputFeatures: any MLFeatureProvider, using state: MLState,
                           options: MLPredictionOptions) throws -> any MLFeatureProvider {
        let declared = Set(function.inputs.map(\.name))
        if let unknown = inputFeatures.featureNames.sorted().first(where: { !declared.contains($0) }) {
            throw MLStandInError("\(function.name) has no input \(unknown); it takes \(function.inputs.map(\.name).joined(separator: ", "))")
        }
        var inputs: [String: Tensor] = [:]
        for spec in function.inputs {
            let wanted = "a multi-array of \(spec.type)\(spec.shape)"
            guard let value = inputFeatures.featureValue(for: spec.name) else {
                throw MLStandInError("\(function.name): input \(spec.name) is missing; it takes \(wanted)")
            }
            guard value.type == .multiArray, let array = value.multiArrayValue else {
                throw MLStandInError("\(function.name): input \(spec.name) is a \(value.type) feature value; it takes \(wanted)")
            }
            guard let type = MLMultiArrayDataType(spec.type), array.dataType == type else {
                throw MLStandInError("\(function.name): input \(spec.name) is a \(array.dataType) multi-array; it takes \(wanted)")
            }
            guard array.shape.map(\.intValue) == spec.shape else {
                throw MLStandInError("\(function.name): input \(spec.name) has shape \(array.shape.map(\.intValue)); it takes \(wanted)")
            }
            inputs[spec.name] = Self.tensor(from: array)
        }
        for spec in function.states {
            guard let buffer = state.store.values[spec.name], buffer.shape == spec.shape, buffer.type == spec.type else {
                throw MLStandInError("the state passed to \(function.name) has no \(spec.type)\(spec.shape) buffer \(spec.name)")
            }
        }
        let outputs = try function.run(inputs: inputs, states: state.store)
        var features: [String: Any] = [:]
        for (name, tensor) in outputs { features[name] = Self.array(from: tensor) }
        return try MLDictionaryFeatureProvider(dictionary: features)
    }

    static func tensor(from array: MLMultiArray) -> Tensor {
        let shape = array.shape.map(\.intValue)
        let offsets = array.byteOffsets()
        return array.withUnsafeBytes { bytes in
            switch array.dataType {
            case .int32:
                return .ints(offsets.map { bytes.loadUnaligned(fromByteOffset: $0, as: Int32.self) }, shape: shape)
            case .float16:
                return .floats(offsets.map { Half.toFloat(bytes.loadUnaligned(fromByteOffset: $0, as: UInt16.self)) }, shape: shape, type: .float16)
            case .float32:
                return .floats(offsets.map { bytes.loadUnaligned(fromByteOffset: $0, as: Float.self) }, shape: shape)
            case .double:
                return .floats(offsets.map { Float(bytes.loadUnaligned(fromByteOffset: $0, as: Double.self)) }, shape: shape)
            }
        }
    }

    /// An output as Core ML may return it: padded strides, the gaps NaN.
    static func array(from tensor: Tensor) -> MLMultiArray {
        let type: MLMultiArrayDataType = tensor.type == .float16 ? .float16 : tensor.type.isFloat ? .float32 : .int32
        let array = MLMultiArray.padded(shape: tensor.shape, dataType: type)
        let offsets = array.byteOffsets()
        array.writeStorage { bytes in
            switch type {
            case .int32:
                let values = tensor.ints()
                for (index, offset) in offsets.enumerated() { bytes.storeBytes(of: values[index], toByteOffset: offset, as: Int32.self) }
            case .float16:
                let values = tensor.floats()
                for (index, offset) in offsets.enumerated() { bytes.storeBytes(of: Half.fromFloat(values[index]), toByteOffset: offset, as: UInt16.self) }
            default:
                let values = tensor.floats()
                for (index, offset) in offsets.enumerated() { bytes.storeBytes(of: values[index], toByteOffset: offset, as: Float.self) }
            }
        }
        return array
    }
}

/// Copies `source` to `destination` (which must not exist), files' contents through symlinks:
/// Bazel's runfiles are links to read-only sources, and a compiled model must stand alone.
func copyResolvingLinks(_ source: URL, to destination: URL) throws {
    let fileManager = FileManager.default
    let root = source.resolvingSymlinksInPath()
    try fileManager.createDirectory(at: destination, withIntermediateDirectories: true)
    guard let walker = fileManager.enumerator(atPath: root.path) else { return }
    while let relative = walker.nextObject() as? String {
        let from = root.appendingPathComponent(relative).resolvingSymlinksInPath()
        let to = destination.appendingPathComponent(relative)
        var isDirectory: ObjCBool = false
        _ = fileManager.fileExists(atPath: from.path, isDirectory: &isDirectory)
        if isDirectory.boolValue {
            try fileManager.createDirectory(at: to, withIntermediateDirectories: true)
        } else {
            try fileManager.copyItem(at: from, to: to)
        }
    }
}
