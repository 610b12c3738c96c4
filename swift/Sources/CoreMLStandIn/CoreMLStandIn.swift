import Foundation
import MILInterpreter

// A stand-in for the part of Apple's Core ML API that museflash's CoreMLBackend uses, with
// Apple's documented Swift declarations and @available attributes (shared/coreml-api.md,
// gathered from Apple's documentation; Tests/CoreMLSurface/apple-coreml-surface.txt lists
// them and MuseflashRuntimeTests checks this module against that list), implemented over the
// Swift ML-program interpreter. It exists so that the backend's source compiles and its code
// paths run in CI on Linux; on Apple platforms the backend imports the real framework.
//
// It is as strict as Core ML's documentation allows, never kinder, so that CI sees what a Mac
// would refuse or get wrong (docs/mac.md):
//   - `MLModel(contentsOf:configuration:)` loads only a compiled model, the `.mlmodelc` that
//     `compileModel(at:)` writes to a new temporary location; an `.mlpackage` is refused.
//   - `MLMultiArray(shape:dataType:)` is contiguous but uninitialised: here filled with NaN
//     (int32: the bits of a float NaN, far outside any vocabulary).
//   - Output arrays come back with padded strides (not contiguous).
//   - `withUnsafeMutableBytes` switches to a backing with other strides on every call (a
//     contiguous array to one with no unit stride), as the documentation allows; the strides
//     it hands over are the ones to write with.
//   - An input of the wrong feature type, data type or shape, a missing or unknown input, and
//     a state lacking a buffer the function declares are refused, naming it.
//   - `modelDescription` describes the loaded function's inputs, outputs and states.
// What it encodes that Apple does not document (the first-run script settles both on a Mac):
//   - a state made by one function's MLModel can be passed to another function of the same
//     package that declares the same states (names, shapes, fp16): accepted when the buffers
//     match the function's declared states, refused otherwise;
//   - per-function MLModels of one package share its weights in memory: here one interpreter
//     program per compiled model serves every function.
// Predictions are synchronous and serialised per state, as Apple requires of callers.

@available(macOS 10.14, iOS 12.0, *)
public enum MLComputeUnits: Int, Sendable {
    case cpuOnly = 0
    case cpuAndGPU = 1
    case all = 2
    @available(macOS 13.0, iOS 16.0, *)
    case cpuAndNeuralEngine = 3
}

@available(macOS 10.13, iOS 11.0, *)
public enum MLMultiArrayDataType: Int, Sendable {
    case double = 0x10040
    case float32 = 0x10020
    @available(macOS 12.0, iOS 16.0, *)
    case float16 = 0x10010
    case int32 = 0x20020

    @available(macOS 11.0, iOS 14.0, *)
    public static var float64: MLMultiArrayDataType { .double }
    @available(macOS 11.0, iOS 14.0, *)
    public static var float: MLMultiArrayDataType { .float32 }
}

extension MLMultiArrayDataType {
    var byteWidth: Int {
        switch self {
        case .double: return 8
        case .float32, .int32: return 4
        case .float16: return 2
        }
    }

    /// What a new array holds before anything is written: NaN of the type (int32: the bits of
    /// an fp32 NaN, 2143289344).
    var poison: [UInt8] {
        switch self {
        case .double: return [0, 0, 0, 0, 0, 0, 0xF8, 0x7F]
        case .float32, .int32: return [0, 0, 0xC0, 0x7F]
        case .float16: return [0, 0x7E]
        }
    }
}

@available(macOS 10.13, iOS 11.0, *)
public enum MLFeatureType: Int, Sendable {
    case int64 = 1
    case double = 2
    case multiArray = 5
    @available(macOS 15.0, iOS 18.0, *)
    case state = 8
}

/// Errors the stand-in reports where Core ML would throw an NSError.
struct MLStandInError: Error, CustomStringConvertible {
    let description: String
    init(_ description: String) { self.description = description }
}

@available(macOS 10.14, iOS 12.0, *)
public final class MLModelConfiguration: @unchecked Sendable {
    @available(macOS 15.0, iOS 18.0, *)
    public var functionName: String?
    @available(macOS 10.14, iOS 12.0, *)
    public var computeUnits: MLComputeUnits = .all
    @available(macOS 10.14, iOS 12.0, *)
    public init() {}
}

@available(macOS 10.13, iOS 11.0, *)
public final class MLPredictionOptions: @unchecked Sendable {
    @available(macOS 11.0, iOS 16.0, *)
    public var outputBackings: [String: Any] = [:]
    @available(macOS 10.13, iOS 11.0, *)
    public init() {}
}

@available(macOS 10.13, iOS 11.0, *)
public final class MLFeatureValue: @unchecked Sendable {
    @available(macOS 10.13, iOS 11.0, *)
    public let type: MLFeatureType
    @available(macOS 10.13, iOS 11.0, *)
    public let multiArrayValue: MLMultiArray?
    @available(macOS 10.13, iOS 11.0, *)
    public let int64Value: Int64

    init(type: MLFeatureType, multiArray: MLMultiArray?, int64: Int64) {
        self.type = type
        multiArrayValue = multiArray
        int64Value = int64
    }

    @available(macOS 10.13, iOS 11.0, *)
    public convenience init(multiArray value: MLMultiArray) {
        self.init(type: .multiArray, multiArray: value, int64: 0)
    }

    @available(macOS 10.13, iOS 11.0, *)
    public convenience init(int64 value: Int64) {
        self.init(type: .int64, multiArray: nil, int64: value)
    }
}

@available(macOS 10.13, iOS 11.0, *)
public protocol MLFeatureProvider {
    @available(macOS 10.13, iOS 11.0, *)
    var featureNames: Set<String> { get }
    @available(macOS 10.13, iOS 11.0, *)
    func featureValue(for featureName: String) -> MLFeatureValue?
}

@available(macOS 10.13, iOS 11.0, *)
public final class MLDictionaryFeatureProvider: MLFeatureProvider, @unchecked Sendable {
    @available(macOS 10.13, iOS 11.0, *)
    public let dictionary: [String: MLFeatureValue]

    /// Values are converted to feature values as Core ML converts them: a multi-array, or an
    /// integer (an int64 feature, which no multi-array input accepts).
    @available(macOS 10.13, iOS 11.0, *)
    public init(dictionary: [String: Any]) throws {
        var values: [String: MLFeatureValue] = [:]
        for (name, value) in dictionary {
            switch value {
            case let feature as MLFeatureValue: values[name] = feature
            case let array as MLMultiArray: values[name] = MLFeatureValue(multiArray: array)
            case let number as Int: values[name] = MLFeatureValue(int64: Int64(number))
            case let number as Int64: values[name] = MLFeatureValue(int64: number)
            case let number as Int32: values[name] = MLFeatureValue(int64: Int64(number))
            default: throw MLStandInError("feature \(name) holds a \(type(of: value)), which is no feature value")
            }
        }
        self.dictionary = values
    }

    @available(macOS 10.13, iOS 11.0, *)
    public var featureNames: Set<String> { Set(dictionary.keys) }
    @available(macOS 10.13, iOS 11.0, *)
    public func featureValue(for featureName: String) -> MLFeatureValue? { dictionary[featureName] }
    @available(macOS 10.13, iOS 11.0, *)
    public subscript(featureName: String) -> MLFeatureValue? { dictionary[featureName] }
}

@available(macOS 10.13, iOS 11.0, *)
public final class MLModelDescription: @unchecked Sendable {
    @available(macOS 10.13, iOS 11.0, *)
    public let inputDescriptionsByName: [String: MLFeatureDescription]
    @available(macOS 10.13, iOS 11.0, *)
    public let outputDescriptionsByName: [String: MLFeatureDescription]
    @available(macOS 15.0, iOS 18.0, *)
    public let stateDescriptionsByName: [String: MLFeatureDescription]
    /// Here only `creatorDefinedKey`: the package spec's user-defined metadata, [String: String].
    @available(macOS 10.13, iOS 11.0, *)
    public let metadata: [MLModelMetadataKey: Any]

    init(function: CompiledFunction, userDefined: [String: String]) {
        metadata = [.creatorDefinedKey: userDefined]
        func described(_ specs: [ValueSpec], as type: MLFeatureType) -> [String: MLFeatureDescription] {
            Dictionary(uniqueKeysWithValues: specs.map { ($0.name, MLFeatureDescription(spec: $0, type: type)) })
        }
        inputDescriptionsByName = described(function.inputs, as: .multiArray)
        outputDescriptionsByName = described(function.outputs, as: .multiArray)
        stateDescriptionsByName = described(function.states, as: .state)
    }
}

/// The keys of `MLModelDescription.metadata`; the stand-in fills only the creator-defined one.
@available(macOS 10.13, iOS 11.0, *)
public struct MLModelMetadataKey: Hashable, Sendable {
    private let name: String

    @available(macOS 10.13, iOS 11.0, *)
    public init(rawValue: String) {
        name = rawValue
    }

    @available(macOS 10.13, iOS 11.0, *)
    public static let creatorDefinedKey: MLModelMetadataKey = MLModelMetadataKey(rawValue: "MLModelCreatorDefinedKey")
}

@available(macOS 10.13, iOS 11.0, *)
public final class MLFeatureDescription: @unchecked Sendable {
    @available(macOS 10.13, iOS 11.0, *)
    public let name: String
    @available(macOS 10.13, iOS 11.0, *)
    public let type: MLFeatureType
    @available(macOS 10.13, iOS 11.0, *)
    public let multiArrayConstraint: MLMultiArrayConstraint?
    @available(macOS 15.0, iOS 18.0, *)
    public let stateConstraint: MLStateConstraint?

    init(spec: ValueSpec, type: MLFeatureType) {
        name = spec.name
        self.type = type
        let dataType = MLMultiArrayDataType(spec.type) ?? .float32
        multiArrayConstraint = type == .multiArray ? MLMultiArrayConstraint(shape: spec.shape, dataType: dataType) : nil
        stateConstraint = type == .state ? MLStateConstraint(bufferShape: spec.shape, dataType: dataType) : nil
    }
}

@available(macOS 10.13, iOS 11.0, *)
public final class MLMultiArrayConstraint: @unchecked Sendable {
    @available(macOS 10.13, iOS 11.0, *)
    public let shape: [NSNumber]
    @available(macOS 10.13, iOS 11.0, *)
    public let dataType: MLMultiArrayDataType

    init(shape: [Int], dataType: MLMultiArrayDataType) {
        self.shape = shape.map { NSNumber(value: $0) }
        self.dataType = dataType
    }
}

@available(macOS 15.0, iOS 18.0, *)
public final class MLStateConstraint: @unchecked Sendable {
    @available(macOS 15.0, iOS 18.0, *)
    public let bufferShape: [Int]
    @available(macOS 15.0, iOS 18.0, *)
    public let dataType: MLMultiArrayDataType

    init(bufferShape: [Int], dataType: MLMultiArrayDataType) {
        self.bufferShape = bufferShape
        self.dataType = dataType
    }
}

extension MLMultiArrayDataType {
    /// The multi-array type of a declared value (nil: no multi-array holds it).
    init?(_ type: ElementType) {
        switch type {
        case .float16: self = .float16
        case .float32: self = .float32
        case .int32: self = .int32
        default: return nil
        }
    }
}
