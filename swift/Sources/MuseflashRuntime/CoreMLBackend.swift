import ExportMetadata
import Foundation
import MILInterpreter
#if canImport(CoreML)
import CoreML
#else
import CoreMLStandIn
#endif

/// Runs the functions with Core ML: one `MLModel` per function (`MLModelConfiguration
/// .functionName`), one `MLState` for the target's functions and one for the drafter's,
/// `MLMultiArray` in and out. On Apple platforms this is the real framework (macOS 15 / iOS 18,
/// which swift/Package.swift declares: multifunction models and states); on Linux the same
/// source compiles against CoreMLStandIn, which is as strict as Core ML's documentation, so CI
/// runs this code path against it (docs/mac.md).
///
/// A package is compiled once into `Options.cacheDirectory`, keyed by its content digest
/// (`CompiledModelCache`), and reused on later launches; a bundle that ships `.mlmodelc` instead
/// of `.mlpackage` is loaded as it is. An `.mlmodelc` beside an `.mlpackage` is ignored: nothing
/// says it was compiled from that package.
///
/// Two behaviours it relies on are not documented by Apple (docs/swift-runtime.md;
/// tools/mac/first_run.sh settles both on a Mac):
///   - the state that one function's model makes (`makeState()`) is passed to the other
///     function of the same state set, once `makeState(for:)` has checked that they declare the
///     same state names, shapes and types (`inject_kv` and `draft`; `prefill` and `main`);
///   - the per-function models of one package share its weights in memory (correctness does
///     not depend on this, memory does: coremltools#2351 reports the opposite).
public final class CoreMLBackend: InferenceBackend {
    public struct Options: Sendable {
        /// `.cpuOnly` decodes exactly as the goldens; the GPU and the Neural Engine compute in
        /// fp16 with other accumulation orders, so near-tied tokens may differ (docs/mac.md).
        public var computeUnits: MLComputeUnits
        /// Where compiled models are kept across launches; nil compiles to a temporary location
        /// on every launch.
        public var cacheDirectory: URL?
        /// Gets one line when something degrades but decoding goes on (an unwritable cache).
        public var warn: @Sendable (String) -> Void

        public init(computeUnits: MLComputeUnits = .all, cacheDirectory: URL? = CompiledModelCache.defaultDirectory,
                    warn: @escaping @Sendable (String) -> Void = { FileHandle.standardError.write(Data(($0 + "\n").utf8)) }) {
            self.computeUnits = computeUnits
            self.cacheDirectory = cacheDirectory
            self.warn = warn
        }
    }

    /// Deliberate damage, for the tests that show the strict stand-in catches each kind of
    /// backend bug it exists for (tests/swift_runtime). Internal: only `@testable` code sets it.
    struct Faults {
        /// Read outputs as if their strides were row-major.
        var assumeContiguousOutputs = false
        /// Write inputs with the strides the array had before `withUnsafeMutableBytes`, not the
        /// ones it hands over.
        var ignoreHandedStrides = false
        /// Store only non-zero input scalars, as if a new array were zero-filled.
        var assumeZeroFilledInputs = false
        /// Pass int32 ids and positions as a `.double` array of their Int64 values.
        var int64IDsAsDoubles = false
        /// Share a state without comparing the functions' state descriptions.
        var skipStateCheck = false
    }
    var faults = Faults()

    public let name = "coreml"
    public let options: Options
    public var computeUnits: MLComputeUnits { options.computeUnits }
    /// How each package's compiled model was found, by the package's (or .mlmodelc's) path.
    public private(set) var compiledModelSources: [String: CompiledModelSource] = [:]
    private var compiled: [String: URL] = [:]

    public init(_ options: Options = Options()) throws {
        self.options = options
    }

    /// `cpu` (exact: the goldens' units), `gpu` (CPU and GPU), `ane` (CPU and Neural Engine),
    /// `all` (Core ML chooses); nil for any other name. docs/mac.md has their speeds.
    public static func computeUnits(named name: String) -> MLComputeUnits? {
        ["cpu": .cpuOnly, "gpu": .cpuAndGPU, "ane": .cpuAndNeuralEngine, "all": .all][name]
    }

    /// The compiled model to load for `model` (an `.mlpackage` or a shipped `.mlmodelc`),
    /// found once per process.
    func compiledModel(_ model: URL) throws -> URL {
        let key = model.standardizedFileURL.path
        if let url = compiled[key] { return url }
        let url: URL, source: CompiledModelSource
        if model.pathExtension == "mlmodelc" {
            (url, source) = (model, .shipped)
        } else if let directory = options.cacheDirectory {
            (url, source) = try CompiledModelCache(directory: directory).compiledModel(
                of: model, compile: { try MLModel.compileModel(at: $0) }, warn: options.warn)
        } else {
            (url, source) = (try MLModel.compileModel(at: model), .compiledTemporarily)
        }
        compiled[key] = url
        compiledModelSources[key] = source
        return url
    }

    public func loadFunction(_ function: String, of package: URL) throws -> any BackendFunction {
        let configuration = MLModelConfiguration()
        configuration.functionName = function
        configuration.computeUnits = options.computeUnits
        let url = try compiledModel(package)
        do {
            let model = try MLModel(contentsOf: url, configuration: configuration)
            if package.pathExtension == "mlmodelc" {
                return ShippedCoreMLFunction(name: function, model: model, faults: faults, path: package.path)
            }
            return CoreMLFunction(name: function, model: model, faults: faults)
        } catch {
            if package.pathExtension == "mlmodelc" {
                throw RuntimeError.compiledModelMismatch(model: package.path, function: function, reason: "\(error)")
            }
            throw RuntimeError.backend(function: function, reason: "Core ML cannot load it from \(url.path): \(error)")
        }
    }

    /// One state for `functions`, made by the first one's model, after checking that every
    /// function declares the same states with the same shapes and types.
    public func makeState(for functions: [any BackendFunction]) throws -> any BackendState {
        let models = try coreMLFunctions(functions)
        guard let first = models.first else { throw RuntimeError.backend(function: "-", reason: "a state for no functions") }
        if !faults.skipStateCheck { try Self.checkSameStates(models) }
        return CoreMLState(model: first.model)
    }

    public func checkSameStates(_ functions: [any BackendFunction]) throws {
        let models = try coreMLFunctions(functions)
        if !faults.skipStateCheck, !models.isEmpty { try Self.checkSameStates(models) }
    }

    /// nil: Core ML lists a package's functions only asynchronously (`MLModelAsset.functionNames`),
    /// so a function metadata.json lists but the package lacks is refused when first loaded.
    public func functionNames(of package: URL) throws -> [String]? { nil }

    private func coreMLFunctions(_ functions: [any BackendFunction]) throws -> [CoreMLFunction] {
        try functions.map { function -> CoreMLFunction in
            guard let model = function as? CoreMLFunction else {
                throw RuntimeError.backend(function: function.name, reason: "not a Core ML function")
            }
            return model
        }
    }

    static func checkSameStates(_ models: [CoreMLFunction]) throws {
        let first = models[0], declared = first.model.modelDescription.stateDescriptionsByName
        for other in models.dropFirst() {
            let states = other.model.modelDescription.stateDescriptionsByName
            for name in Set(declared.keys).union(states.keys).sorted() {
                guard let mine = declared[name]?.stateConstraint else {
                    throw RuntimeError.backend(function: other.name, reason: "declares state \(name), which \(first.name) of the same state set does not; they cannot share one state")
                }
                guard let theirs = states[name]?.stateConstraint else {
                    throw RuntimeError.backend(function: other.name, reason: "does not declare state \(name), which \(first.name) of the same state set does; they cannot share one state")
                }
                guard mine.bufferShape == theirs.bufferShape, mine.dataType == theirs.dataType else {
                    throw RuntimeError.backend(function: other.name, reason: "state \(name) is \(theirs.dataType)\(theirs.bufferShape) here but \(mine.dataType)\(mine.bufferShape) in \(first.name) of the same state set; they cannot share one state")
                }
            }
        }
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

    /// Through `MLState.withMultiArray(for:)`, which Apple documents as a mutable view of one
    /// named state buffer, valid inside the closure, not to be touched while a prediction is
    /// in flight (predictions here are serialised). Assumed, as everywhere in this engine: the
    /// buffer is the one every function of the package reads (docs/mac.md). fp16 rows, copied
    /// by the strides the view gives.
    func moveRows(_ moves: [(from: Int, to: Int)], inStates names: [String]) throws {
        for name in names {
            try state.withMultiArray(for: name) { array in
                let shape = array.shape.map(\.intValue)
                guard shape.count >= 2, array.dataType == .float16 else {
                    throw RuntimeError.backend(function: "tree", reason: "state \(name) is not fp16 [..., capacity, head_dim]")
                }
                let capacity = shape[shape.count - 2], width = shape[shape.count - 1]
                let leading = Array(shape.dropLast(2))
                array.withUnsafeMutableBytes { bytes, strides in
                    let slotStride = strides[strides.count - 2], columnStride = strides[strides.count - 1]
                    var index = [Int](repeating: 0, count: leading.count)
                    repeat {
                        let base = zip(index, strides).reduce(0) { $0 + $1.0 * $1.1 }
                        for move in moves {
                            let from = base + (move.from % capacity) * slotStride
                            let to = base + (move.to % capacity) * slotStride
                            for column in 0..<width {
                                let value = bytes.load(fromByteOffset: 2 * (from + column * columnStride), as: UInt16.self)
                                bytes.storeBytes(of: value, toByteOffset: 2 * (to + column * columnStride), as: UInt16.self)
                            }
                        }
                    } while Self.advance(&index, within: leading)
                }
            }
        }
    }

    /// The next index of an array of shape `shape` in row-major order; false past the last.
    private static func advance(_ index: inout [Int], within shape: [Int]) -> Bool {
        for axis in stride(from: shape.count - 1, through: 0, by: -1) {
            index[axis] += 1
            if index[axis] < shape[axis] { return true }
            index[axis] = 0
        }
        return false
    }
}

/// A function of a compiled model the bundle ships; its creator-defined metadata is what Core ML
/// documents for `MLModelDescription.metadata[.creatorDefinedKey]`, the spec's `userDefined`.
final class ShippedCoreMLFunction: CoreMLFunction, ShippedCompiledModel {
    let compiledModelPath: String

    init(name: String, model: MLModel, faults: CoreMLBackend.Faults, path: String) {
        compiledModelPath = path
        super.init(name: name, model: model, faults: faults)
    }

    var embeddedMetadata: String? {
        (model.modelDescription.metadata[.creatorDefinedKey] as? [String: String])?[BundleContract.embeddedMetadataKey]
    }
}

class CoreMLFunction: BackendFunction {
    let name: String
    let model: MLModel
    let faults: CoreMLBackend.Faults

    init(name: String, model: MLModel, faults: CoreMLBackend.Faults) {
        self.name = name
        self.model = model
        self.faults = faults
    }

    func predict(_ inputs: [String: ShapedArray], state: any BackendState) throws -> [String: ShapedArray] {
        guard let state = state as? CoreMLState else {
            throw RuntimeError.backend(function: name, reason: "a state made by another backend")
        }
        var features: [String: Any] = [:]
        for (key, array) in inputs {
            features[key] = MLFeatureValue(multiArray: try multiArray(array))
        }
        let output: any MLFeatureProvider
        do {
            output = try model.prediction(from: try MLDictionaryFeatureProvider(dictionary: features), using: state.state)
        } catch {
            throw RuntimeError.backend(function: name, reason: "Core ML prediction failed: \(error)")
        }
        var result: [String: ShapedArray] = [:]
        for key in output.featureNames {
            guard let array = output.featureValue(for: key)?.multiArrayValue else { continue }
            result[key] = try shapedArray(array)
        }
        return result
    }

    /// int32 ids and positions as int32; float inputs (the drafter's `features`) as fp16, the
    /// type the bundle contract gives them. Written at the strides `withUnsafeMutableBytes`
    /// hands over, which may differ from the array's before the call.
    func multiArray(_ array: ShapedArray) throws -> MLMultiArray {
        let shape = array.shape.map { NSNumber(value: $0) }
        switch array.scalars {
        case .int32(let values) where faults.int64IDsAsDoubles:
            let result = try MLMultiArray(shape: shape, dataType: .double)
            write(result, shape: array.shape) { bytes, index, offset in
                bytes.storeBytes(of: Double(Int64(values[index])), toByteOffset: offset * 8, as: Double.self)
            }
            return result
        case .int32(let values):
            let result = try MLMultiArray(shape: shape, dataType: .int32)
            write(result, shape: array.shape) { bytes, index, offset in
                if faults.assumeZeroFilledInputs, values[index] == 0 { return }
                bytes.storeBytes(of: values[index], toByteOffset: offset * 4, as: Int32.self)
            }
            return result
        case .float(let values):
            let result = try MLMultiArray(shape: shape, dataType: .float16)
            write(result, shape: array.shape) { bytes, index, offset in
                if faults.assumeZeroFilledInputs, values[index] == 0 { return }
                bytes.storeBytes(of: Half.fromFloat(values[index]), toByteOffset: offset * 2, as: UInt16.self)
            }
            return result
        }
    }

    private func write(_ array: MLMultiArray, shape: [Int], _ store: (UnsafeMutableRawBufferPointer, Int, Int) -> Void) {
        let before = array.strides.map(\.intValue)
        array.withUnsafeMutableBytes { bytes, strides in
            forEachOffset(shape: shape, strides: faults.ignoreHandedStrides ? before : strides) { store(bytes, $0, $1) }
        }
    }

    /// An output read at its own strides: Core ML may pad rows.
    func shapedArray(_ array: MLMultiArray) throws -> ShapedArray {
        let shape = array.shape.map(\.intValue)
        let strides = faults.assumeContiguousOutputs ? rowMajorStrides(shape) : array.strides.map(\.intValue)
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
                throw RuntimeError.badOutput(function: name, reason: "a multi-array of an unsupported data type")
            }
        }
    }
}

func rowMajorStrides(_ shape: [Int]) -> [Int] {
    var strides = [Int](repeating: 1, count: shape.count)
    for axis in stride(from: shape.count - 2, through: 0, by: -1) { strides[axis] = strides[axis + 1] * shape[axis + 1] }
    return strides
}
