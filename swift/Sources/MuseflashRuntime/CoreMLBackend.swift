import Foundation
import MILInterpreter
#if canImport(CoreML)
import CoreML
#else
import CoreMLStandIn
#endif

/// Runs the functions with Core ML: one `MLModel` per function (`MLModelConfiguration
/// .functionName`), one `MLState` for the target's functions and one for the drafter's,
/// `MLMultiArray` in and out. On Apple platforms this is the real framework (iOS 18 / macOS 15:
/// multifunction models and states); on Linux the same source compiles against CoreMLStandIn,
/// which implements the API over the Swift interpreter, so CI runs this code path.
///
/// Two behaviours it relies on are not documented by Apple (docs/swift-runtime.md):
///   - the state that one function's model makes (`makeState()`) is passed to the other
///     function of the same state set, which declares the same state names, shapes and fp16
///     type (`inject_kv` and `draft`; `prefill` and `main`);
///   - the per-function models of one package share its weights in memory (correctness does
///     not depend on this, memory does: coremltools#2351 reports the opposite).
public final class CoreMLBackend: InferenceBackend {
    public let name = "coreml"
    public let computeUnits: MLComputeUnits
    private var compiled: [String: URL] = [:]

    public init(computeUnits: MLComputeUnits = .all) throws {
        self.computeUnits = computeUnits
    }

    /// A compiled model to load: an `.mlmodelc` as it is (Xcode compiles packages it bundles),
    /// an `.mlpackage` compiled once per process.
    private func compiledModel(_ package: URL) throws -> URL {
        if package.pathExtension == "mlmodelc" { return package }
        let key = package.standardizedFileURL.path
        if let url = compiled[key] { return url }
        let sibling = package.deletingPathExtension().appendingPathExtension("mlmodelc")
        let url = FileManager.default.fileExists(atPath: sibling.path) ? sibling : try MLModel.compileModel(at: package)
        compiled[key] = url
        return url
    }

    public func loadFunction(_ function: String, of package: URL) throws -> any BackendFunction {
        let configuration = MLModelConfiguration()
        configuration.functionName = function
        configuration.computeUnits = computeUnits
        let model = try MLModel(contentsOf: compiledModel(package), configuration: configuration)
        return CoreMLFunction(name: function, model: model)
    }

    public func makeState(for functions: [any BackendFunction]) throws -> any BackendState {
        guard let first = functions.first as? CoreMLFunction else {
            throw RuntimeError.backend(function: functions.first?.name ?? "-", reason: "not a Core ML function")
        }
        return CoreMLState(model: first.model)
    }
}

final class CoreMLState: BackendState {
    let model: MLModel
    var state: MLState

    init(model: MLModel) {
        self.model = model
        state = model.makeState()
    }

    /// A fresh state: Core ML allocates state buffers zero-initialised.
    func reset() throws {
        state = model.makeState()
    }
}

final class CoreMLFunction: BackendFunction {
    let name: String
    let model: MLModel

    init(name: String, model: MLModel) {
        self.name = name
        self.model = model
    }

    func predict(_ inputs: [String: ShapedArray], state: any BackendState) throws -> [String: ShapedArray] {
        guard let state = state as? CoreMLState else {
            throw RuntimeError.backend(function: name, reason: "a state made by another backend")
        }
        var features: [String: Any] = [:]
        for (key, array) in inputs {
            features[key] = MLFeatureValue(multiArray: try Self.multiArray(array))
        }
        let output = try model.prediction(from: try MLDictionaryFeatureProvider(dictionary: features), using: state.state)
        var result: [String: ShapedArray] = [:]
        for key in output.featureNames {
            guard let array = output.featureValue(for: key)?.multiArrayValue else { continue }
            result[key] = try Self.shapedArray(array)
        }
        return result
    }

    /// int32 ids and positions as int32; float inputs (the drafter's `features`) as fp16, the
    /// type the bundle contract gives them.
    static func multiArray(_ array: ShapedArray) throws -> MLMultiArray {
        let shape = array.shape.map { NSNumber(value: $0) }
        switch array.scalars {
        case .int32(let values):
            let result = try MLMultiArray(shape: shape, dataType: .int32)
            result.withUnsafeMutableBytes { bytes, strides in
                forEachOffset(shape: array.shape, strides: strides) { index, offset in
                    bytes.storeBytes(of: values[index], toByteOffset: offset * 4, as: Int32.self)
                }
            }
            return result
        case .float(let values):
            let result = try MLMultiArray(shape: shape, dataType: .float16)
            result.withUnsafeMutableBytes { bytes, strides in
                forEachOffset(shape: array.shape, strides: strides) { index, offset in
                    bytes.storeBytes(of: Half.fromFloat(values[index]), toByteOffset: offset * 2, as: UInt16.self)
                }
            }
            return result
        }
    }

    static func shapedArray(_ array: MLMultiArray) throws -> ShapedArray {
        let shape = array.shape.map(\.intValue)
        let strides = array.strides.map(\.intValue)
        let count = shape.reduce(1, *)
        return try array.withUnsafeBytes { bytes -> ShapedArray in
            switch array.dataType {
            case .int32:
                var values = [Int32](repeating: 0, count: count)
                forEachOffset(shape: shape, strides: strides) { values[$0] = bytes.loadUnaligned(fromByteOffset: $1 * 4, as: Int32.self) }
                return ShapedArray(int32: values, shape: shape)
            case .float16:
                var values = [Float](repeating: 0, count: count)
                forEachOffset(shape: shape, strides: strides) { values[$0] = Half.toFloat(bytes.loadUnaligned(fromByteOffset: $1 * 2, as: UInt16.self)) }
                return ShapedArray(float: values, shape: shape)
            case .float32:
                var values = [Float](repeating: 0, count: count)
                forEachOffset(shape: shape, strides: strides) { values[$0] = bytes.loadUnaligned(fromByteOffset: $1 * 4, as: Float.self) }
                return ShapedArray(float: values, shape: shape)
            case .double:
                var values = [Float](repeating: 0, count: count)
                forEachOffset(shape: shape, strides: strides) { values[$0] = Float(bytes.loadUnaligned(fromByteOffset: $1 * 8, as: Double.self)) }
                return ShapedArray(float: values, shape: shape)
            @unknown default:
                throw RuntimeError.badOutput(function: "-", reason: "a multi-array of an unsupported data type")
            }
        }
    }
}

/// Calls `body(row-major index, element offset by strides)` for every element.
func forEachOffset(shape: [Int], strides: [Int], _ body: (Int, Int) -> Void) {
    let count = shape.reduce(1, *)
    for index in 0..<count {
        var rest = index, offset = 0
        for axis in stride(from: shape.count - 1, through: 0, by: -1) {
            offset += (rest % shape[axis]) * strides[axis]
            rest /= shape[axis]
        }
        body(index, offset)
    }
}
