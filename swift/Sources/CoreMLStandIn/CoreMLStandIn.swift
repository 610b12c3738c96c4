import Foundation
import MILInterpreter

// A stand-in for the part of Apple's Core ML API that museflash's CoreMLBackend uses, with
// Apple's documented Swift signatures (shared/coreml-api.md, gathered from Apple's
// documentation), implemented over the Swift ML-program interpreter. It exists so that the
// backend's source compiles and its code paths run in CI on Linux; on Apple platforms the same
// backend file imports the real framework instead (`#if canImport(CoreML)`).
//
// What it encodes about Core ML's behaviour, each written down in docs/swift-runtime.md:
//   1. `makeState()` gives zero-filled buffers (documented).
//   2. A state made by one function's MLModel can be passed to another function of the same
//      package that declares the same states (names, shapes, fp16). NOT documented by Apple;
//      Anemll's runtime relies on it, and coremltools PR #2686 proposes it. This stand-in
//      accepts any MLState whose buffers match the function's declared states, and refuses
//      one that does not.
//   3. Per-function MLModels of one package share its weights in memory. NOT documented
//      (coremltools#2351 reports memory growing with the number of functions); here one
//      interpreter program per package serves every function.
//   4. `compileModel(at:)` returns a URL to load from; here it is the .mlpackage itself (the
//      interpreter reads packages directly).
// Predictions are synchronous and serialised per state, as Apple requires of callers.

public enum MLComputeUnits: Int, Sendable {
    case cpuOnly = 0
    case cpuAndGPU = 1
    case all = 2
    case cpuAndNeuralEngine = 3
}

public enum MLMultiArrayDataType: Int, Sendable {
    case double = 0x10040
    case float32 = 0x10020
    case float16 = 0x10010
    case int32 = 0x20020

    public static var float64: MLMultiArrayDataType { .double }
    public static var float: MLMultiArrayDataType { .float32 }

    var byteWidth: Int {
        switch self {
        case .double: return 8
        case .float32, .int32: return 4
        case .float16: return 2
        }
    }
}

/// Errors the stand-in reports where Core ML would throw an NSError.
public struct MLStandInError: Error, CustomStringConvertible {
    public let description: String
    init(_ description: String) { self.description = description }
}

public final class MLModelConfiguration: @unchecked Sendable {
    public var functionName: String?
    public var computeUnits: MLComputeUnits = .all
    public init() {}
}

public final class MLPredictionOptions: @unchecked Sendable {
    public var outputBackings: [String: Any] = [:]
    public init() {}
}

/// A contiguous, first-major multi-array that owns its bytes.
public final class MLMultiArray: @unchecked Sendable {
    public let shape: [NSNumber]
    public let strides: [NSNumber]
    public let dataType: MLMultiArrayDataType
    public var count: Int { shape.reduce(1) { $0 * $1.intValue } }
    private var storage: [UInt8]

    /// Contents uninitialised per Apple's documentation; zeros here.
    public init(shape: [NSNumber], dataType: MLMultiArrayDataType) throws {
        guard shape.allSatisfy({ $0.intValue >= 0 }) else { throw MLStandInError("negative shape \(shape)") }
        self.shape = shape
        self.dataType = dataType
        var strides: [NSNumber] = []
        var running = 1
        for size in shape.reversed() {
            strides.insert(NSNumber(value: running), at: 0)
            running *= size.intValue
        }
        self.strides = strides
        storage = [UInt8](repeating: 0, count: running * dataType.byteWidth)
    }

    public func withUnsafeBytes<R>(_ body: (UnsafeRawBufferPointer) throws -> R) rethrows -> R {
        try storage.withUnsafeBytes(body)
    }

    public func withUnsafeMutableBytes<R>(_ body: (UnsafeMutableRawBufferPointer, [Int]) throws -> R) rethrows -> R {
        let strides = self.strides.map(\.intValue)
        return try storage.withUnsafeMutableBytes { try body($0, strides) }
    }
}

public final class MLFeatureValue: @unchecked Sendable {
    public let multiArrayValue: MLMultiArray?
    public init(multiArray value: MLMultiArray) { multiArrayValue = value }
}

public protocol MLFeatureProvider {
    var featureNames: Set<String> { get }
    func featureValue(for featureName: String) -> MLFeatureValue?
}

public final class MLDictionaryFeatureProvider: MLFeatureProvider, @unchecked Sendable {
    public let dictionary: [String: MLFeatureValue]

    public init(dictionary: [String: Any]) throws {
        var values: [String: MLFeatureValue] = [:]
        for (name, value) in dictionary {
            if let feature = value as? MLFeatureValue { values[name] = feature }
            else if let array = value as? MLMultiArray { values[name] = MLFeatureValue(multiArray: array) }
            else { throw MLStandInError("feature \(name) is not an MLMultiArray or MLFeatureValue") }
        }
        self.dictionary = values
    }

    public var featureNames: Set<String> { Set(dictionary.keys) }
    public func featureValue(for featureName: String) -> MLFeatureValue? { dictionary[featureName] }
    public subscript(featureName: String) -> MLFeatureValue? { dictionary[featureName] }
}

/// A handle to state buffers; only `MLModel.makeState()` makes one.
public final class MLState: @unchecked Sendable {
    let store: StateStore

    fileprivate init(store: StateStore) { self.store = store }

    /// A mutable view of one state buffer (fp16), valid inside `body` only.
    public func withMultiArray<R>(for stateName: String, _ body: (MLMultiArray) throws -> R) rethrows -> R {
        guard let tensor = store.values[stateName] else {
            preconditionFailure("MLState has no state named \(stateName)")
        }
        // Copy in, run, copy back: the view semantics the documentation describes.
        let array = try! MLMultiArray(shape: tensor.shape.map { NSNumber(value: $0) }, dataType: .float16)
        let values = tensor.floats()
        array.withUnsafeMutableBytes { bytes, _ in
            for (index, value) in values.enumerated() { bytes.storeBytes(of: Half.fromFloat(value).littleEndian, toByteOffset: index * 2, as: UInt16.self) }
        }
        let result = try body(array)
        let written: [Float] = array.withUnsafeBytes { bytes in
            (0..<values.count).map { Half.toFloat(UInt16(littleEndian: bytes.loadUnaligned(fromByteOffset: $0 * 2, as: UInt16.self))) }
        }
        store.values[stateName] = .floats(written, shape: tensor.shape, type: .float16)
        return result
    }
}

/// One function of a compiled model (Core ML: one MLModel instance per function).
public final class MLModel: @unchecked Sendable {
    private static let lock = NSLock()
    private static var programs: [String: PackageProgram] = [:]

    private let function: CompiledFunction

    /// The stand-in reads packages directly, so the "compiled" model is the package itself.
    public class func compileModel(at modelURL: URL) throws -> URL {
        guard FileManager.default.fileExists(atPath: modelURL.path) else {
            throw MLStandInError("no model at \(modelURL.path)")
        }
        return modelURL
    }

    public convenience init(contentsOf url: URL) throws {
        try self.init(contentsOf: url, configuration: MLModelConfiguration())
    }

    public init(contentsOf url: URL, configuration: MLModelConfiguration) throws {
        let key = url.standardizedFileURL.path
        let program: PackageProgram = try Self.lock.withLock {
            if let existing = Self.programs[key] { return existing }
            let opened = try PackageProgram(packageURL: url)
            Self.programs[key] = opened
            return opened
        }
        let name = configuration.functionName ?? program.package.description.defaultFunctionName
        function = try program.function(named: name.isEmpty ? "main" : name)
    }

    public func makeState() -> MLState {
        MLState(store: StateStore(specs: function.states))
    }

    public func prediction(from inputFeatures: any MLFeatureProvider, using state: MLState) throws -> any MLFeatureProvider {
        try prediction(from: inputFeatures, using: state, options: MLPredictionOptions())
    }

    public func prediction(from inputFeatures: any MLFeatureProvider, using state: MLState,
                           options: MLPredictionOptions) throws -> any MLFeatureProvider {
        var inputs: [String: Tensor] = [:]
        for name in inputFeatures.featureNames {
            guard let array = inputFeatures.featureValue(for: name)?.multiArrayValue else {
                throw MLStandInError("input \(name) is not a multi-array")
            }
            inputs[name] = Self.tensor(from: array)
        }
        for spec in function.states {
            guard let buffer = state.store.values[spec.name], buffer.shape == spec.shape, buffer.type == spec.type else {
                throw MLStandInError("the state passed to \(function.name) has no \(spec.type)\(spec.shape) buffer \(spec.name)")
            }
        }
        let outputs = try function.run(inputs: inputs, states: state.store)
        var features: [String: Any] = [:]
        for (name, tensor) in outputs { features[name] = try Self.array(from: tensor) }
        return try MLDictionaryFeatureProvider(dictionary: features)
    }

    static func tensor(from array: MLMultiArray) -> Tensor {
        let shape = array.shape.map(\.intValue)
        let strides = array.strides.map(\.intValue)
        let count = array.count
        let offsets = (0..<count).map { position -> Int in
            var rest = position, offset = 0
            for axis in stride(from: shape.count - 1, through: 0, by: -1) {
                offset += (rest % shape[axis]) * strides[axis]
                rest /= shape[axis]
            }
            return offset
        }
        return array.withUnsafeBytes { bytes in
            switch array.dataType {
            case .int32:
                return .ints(offsets.map { bytes.loadUnaligned(fromByteOffset: $0 * 4, as: Int32.self) }, shape: shape)
            case .float16:
                return .floats(offsets.map { Half.toFloat(bytes.loadUnaligned(fromByteOffset: $0 * 2, as: UInt16.self)) }, shape: shape, type: .float16)
            case .float32:
                return .floats(offsets.map { bytes.loadUnaligned(fromByteOffset: $0 * 4, as: Float.self) }, shape: shape)
            case .double:
                return .floats(offsets.map { Float(bytes.loadUnaligned(fromByteOffset: $0 * 8, as: Double.self)) }, shape: shape)
            }
        }
    }

    static func array(from tensor: Tensor) throws -> MLMultiArray {
        let type: MLMultiArrayDataType = tensor.type == .float16 ? .float16 : tensor.type.isFloat ? .float32 : .int32
        let array = try MLMultiArray(shape: tensor.shape.map { NSNumber(value: $0) }, dataType: type)
        array.withUnsafeMutableBytes { bytes, _ in
            switch type {
            case .int32:
                for (index, value) in tensor.ints().enumerated() { bytes.storeBytes(of: value, toByteOffset: index * 4, as: Int32.self) }
            case .float16:
                for (index, value) in tensor.floats().enumerated() { bytes.storeBytes(of: Half.fromFloat(value), toByteOffset: index * 2, as: UInt16.self) }
            default:
                for (index, value) in tensor.floats().enumerated() { bytes.storeBytes(of: value, toByteOffset: index * 4, as: Float.self) }
            }
        }
        return array
    }
}
