import Foundation
import MILInterpreter

/// Runs each function's ML program with the Swift interpreter (MILInterpreter): any platform,
/// no Core ML. A package's weight files are mapped once and shared by all of its functions.
public final class InterpreterBackend: InferenceBackend {
    public let name = "interpreter"
    private var programs: [String: PackageProgram] = [:]
    /// Time each op type of every function loaded from now on (`CompiledFunction.profiling`):
    /// a benchmark's figure, read back with `opSeconds` (swift-generate --profile-ops).
    public var profileOps = false
    private var loaded: [CompiledFunction] = []

    public init() {}

    /// Per function name, the seconds its calls have spent in each op type while profiled.
    public var opSeconds: [String: [String: Double]] {
        var result: [String: [String: Double]] = [:]
        for function in loaded {
            result[function.name, default: [:]].merge(function.opSeconds, uniquingKeysWith: +)
        }
        return result
    }

    /// The program of `package`, opened once.
    public func program(of package: URL) throws -> PackageProgram {
        let key = package.standardizedFileURL.path
        if let program = programs[key] { return program }
        let program = try PackageProgram(packageURL: package)
        programs[key] = program
        return program
    }

    public func loadFunction(_ function: String, of package: URL) throws -> any BackendFunction {
        guard package.pathExtension != "mlmodelc" else {
            throw RuntimeError.backend(function: function, reason: "\(package.path) is a compiled Core ML model, which the interpreter cannot read; use the Core ML backend, or ship the bundle's .mlpackage")
        }
        let compiled: CompiledFunction
        do {
            compiled = try program(of: package).function(named: function)
        } catch InterpreterError.noSuchFunction(let name, let available) {
            // metadata.json lists it (a context bucket's, say) but this package lacks it.
            throw RuntimeError.functionMissing(package: package.lastPathComponent, function: name, available: available)
        }
        if profileOps {
            compiled.profiling = true
            if !loaded.contains(where: { $0 === compiled }) { loaded.append(compiled) }
        }
        return InterpretedFunction(compiled)
    }

    public func makeState(for functions: [any BackendFunction]) throws -> any BackendState {
        InterpreterState(StateStore(specs: try stateSpecs(functions).values.sorted { $0.name < $1.name }))
    }

    public func checkSameStates(_ functions: [any BackendFunction]) throws {
        _ = try stateSpecs(functions)
    }

    public func functionNames(of package: URL) throws -> [String]? {
        package.pathExtension == "mlmodelc" ? nil : try program(of: package).functionNames
    }

    private func stateSpecs(_ functions: [any BackendFunction]) throws -> [String: ValueSpec] {
        var specs: [String: ValueSpec] = [:]
        for case let function as InterpretedFunction in functions {
            for spec in function.compiled.states {
                if let other = specs[spec.name], other != spec {
                    throw RuntimeError.backend(function: function.name, reason: "state \(spec.name) is \(spec.type)\(spec.shape) here but \(other.type)\(other.shape) in another function of the same state")
                }
                specs[spec.name] = spec
            }
        }
        return specs
    }

    /// Bytes of weight files mapped by every program opened so far.
    public var mappedWeightBytes: Int { programs.values.reduce(0) { $0 + $1.mappedWeightBytes } }
}

final class InterpreterState: BackendState {
    let store: StateStore
    init(_ store: StateStore) { self.store = store }
    func reset() throws { store.reset() }

    func moveRows(_ moves: [(from: Int, to: Int)], inStates names: [String]) throws {
        for name in names {
            guard var tensor = store.values[name], tensor.shape.count >= 2 else {
                throw RuntimeError.backend(function: "tree", reason: "the state has no \(name) of [..., capacity, head_dim]")
            }
            store.values[name] = nil
            var values = tensor.floats()
            tensor.data = .float([])  // the values' only reference: moved in place, not copied
            let capacity = tensor.shape[tensor.shape.count - 2], width = tensor.shape[tensor.shape.count - 1]
            for outer in 0..<(values.count / max(1, capacity * width)) {
                for move in moves {
                    let from = (outer * capacity + move.from % capacity) * width
                    let to = (outer * capacity + move.to % capacity) * width
                    for column in 0..<width { values[to + column] = values[from + column] }
                }
            }
            tensor.data = .float(values)
            store.values[name] = tensor
        }
    }
}

final class InterpretedFunction: BackendFunction {
    let compiled: CompiledFunction
    var name: String { compiled.name }

    init(_ compiled: CompiledFunction) { self.compiled = compiled }

    func predict(_ inputs: [String: ShapedArray], state: any BackendState) throws -> [String: ShapedArray] {
        guard let state = state as? InterpreterState else {
            throw RuntimeError.backend(function: name, reason: "a state made by another backend")
        }
        var tensors: [String: Tensor] = [:]
        for (key, array) in inputs {
            switch array.scalars {
            case .int32(let values): tensors[key] = .ints(values, shape: array.shape)
            case .float(let values): tensors[key] = .floats(values, shape: array.shape)
            }
        }
        let outputs = try compiled.run(inputs: tensors, states: state.store)
        return outputs.mapValues { tensor in
            tensor.type.isFloat ? ShapedArray(float: tensor.floats(), shape: tensor.shape)
                : ShapedArray(int32: tensor.ints(), shape: tensor.shape)
        }
    }
}
