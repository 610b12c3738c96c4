import Foundation
import MLPackage

/// A declared input, output or state: its name, element type and static shape.
public struct ValueSpec: Sendable, Equatable {
    public var name: String
    public var type: ElementType
    public var shape: [Int]
}

/// The states a function reads and writes, owned by the caller and passed to every call, so
/// that functions declaring the same states (e.g. `inject_kv` and `draft`) share them. Each
/// value is an fp16 tensor of the state's declared shape; a new store holds zeros, as Core ML's
/// `makeState()` does.
public final class StateStore: @unchecked Sendable {
    public var values: [String: Tensor]

    public init(specs: [ValueSpec]) {
        values = [:]
        for spec in specs {
            values[spec.name] = Tensor(shape: spec.shape, type: spec.type,
                                       data: .float([Float](repeating: 0, count: elementCount(spec.shape))))
        }
    }

    public func reset() {
        for (name, value) in values {
            values[name] = Tensor(shape: value.shape, type: value.type,
                                  data: .float([Float](repeating: 0, count: value.count)))
        }
    }
}

/// The ML program of one `.mlpackage`: its weight files mapped once, its functions compiled on
/// first use and kept, so every function reads the same weight constants.
public final class PackageProgram: @unchecked Sendable {
    public let package: MLPackage
    private let weights: WeightStore
    private var compiled: [String: CompiledFunction] = [:]
    private let lock = NSLock()

    public init(packageURL: URL) throws {
        package = try MLPackage.open(at: packageURL)
        guard package.specification.program != nil else {
            throw InterpreterError.badProgram(function: "-", reason: "\(packageURL.path) holds no ML program")
        }
        weights = WeightStore(package: package)
    }

    public var functionNames: [String] { package.specification.program?.functions.map { $0.name } ?? [] }

    /// Bytes of weight files this program has mapped.
    public var mappedWeightBytes: Int { lock.withLock { weights.mappedBytes } }

    public func function(named name: String) throws -> CompiledFunction {
        try lock.withLock {
            if let function = compiled[name] { return function }
            guard let program = package.specification.program,
                  let function = program.function(named: name) else {
                throw InterpreterError.noSuchFunction(name: name, available: functionNames)
            }
            let result = try CompiledFunction(function: function, weights: weights)
            compiled[name] = result
            return result
        }
    }
}

enum ArgumentItem {
    case slot(Int)
    case state(String)
    case value(Tensor)
}

struct CompiledOp {
    let type: String
    /// The op's first output name, which coremltools also uses as the op's name.
    let name: String
    let kernel: Kernel
    let arguments: [String: [ArgumentItem]]
    let outputSlots: [Int]
    let outputSpecs: [(type: ElementType, shape: [Int]?)]
    /// The named weights (`p_...` constants, as torch.export names parameters) it reads: what
    /// places a non-finite result in a layer.
    var weights: [String] = []
    /// Slots no later op reads, freed after this one.
    var releases: [Int] = []
    /// A `slice_update` that is the last reader of its `x`: the kernel gets that value moved
    /// out of the frame, so it updates it in place instead of copying it (`OpArguments.owned`).
    var consumesX: Int?
    /// The state whose `read_state` value `consumesX` is, when a later `coreml_update_state`
    /// writes it back: the store lets go of its reference first, so that value is unique too.
    var consumesState: String?
}

/// One function of a program, ready to run: constants evaluated, every value given a slot.
public final class CompiledFunction: @unchecked Sendable {
    public let name: String
    public let inputs: [ValueSpec]
    public let states: [ValueSpec]
    public let outputs: [ValueSpec]
    let constants: [(slot: Int, tensor: Tensor)]
    let operations: [CompiledOp]
    let inputSlots: [Int]
    let outputSlots: [Int]
    let slotCount: Int
    /// Seconds spent in each op type (its kernel, its results' conversions and checks), summed
    /// over calls while `profiling` is on: a benchmark's figure (swift-generate --profile-ops),
    /// never a test's.
    public var profiling = false
    public private(set) var opSeconds: [String: Double] = [:]

    init(function: MILFunction, weights: WeightStore) throws {
        let name = function.name
        self.name = name
        guard let block = function.block else {
            throw InterpreterError.badProgram(function: function.name, reason: "no block for its opset \(function.opset)")
        }
        var slots: [String: Int] = [:]
        func slot(_ value: String) -> Int {
            if let existing = slots[value] { return existing }
            slots[value] = slots.count
            return slots.count - 1
        }
        var inputs: [ValueSpec] = []
        var states: [ValueSpec] = []
        var stateNames = Set<String>()
        var inputSlots: [Int] = []
        for input in function.inputs {
            if let tensor = input.type?.stateTensorType {
                guard let type = ElementType(tensor.dataType), let shape = tensor.shape else {
                    throw InterpreterError.badProgram(function: name, reason: "state \(input.name) has no static fp16 shape")
                }
                states.append(ValueSpec(name: input.name, type: type, shape: shape.map(Int.init)))
                stateNames.insert(input.name)
            } else if let tensor = input.tensorType {
                guard let type = ElementType(tensor.dataType), let shape = tensor.shape else {
                    throw InterpreterError.badProgram(function: name, reason: "input \(input.name) has no static shape")
                }
                inputs.append(ValueSpec(name: input.name, type: type, shape: shape.map(Int.init)))
                inputSlots.append(slot(input.name))
            } else {
                throw InterpreterError.badProgram(function: name, reason: "input \(input.name) is neither a tensor nor a state")
            }
        }
        self.inputs = inputs
        self.states = states
        self.inputSlots = inputSlots

        /// A value given in the spec: a blob of a weight file, or immediate contents.
        func constant(_ value: MILValue, type: MILTensorType?) throws -> Tensor {
            if let blob = value.blob {
                guard let type = type ?? value.tensorType else { throw KernelError("a blob value without a tensor type") }
                return try weights.tensor(for: blob, type: type)
            }
            return try immediateTensor(value, type: type ?? value.tensorType)
        }
        var constants: [(slot: Int, tensor: Tensor)] = []
        var constantValues: [String: Tensor] = [:]
        /// The weight blob each `const` read, by its output's name.
        var constantBlobs: [String: MILBlobReference] = [:]
        var operations: [CompiledOp] = []
        var unsupported: [String] = []
        var declared: [String: MILTensorType] = [:]
        for (index, op) in block.operations.enumerated() {
            let opName = op.outputs.first?.name ?? "#\(index)"
            for output in op.outputs { if let type = output.tensorType { declared[output.name] = type } }
            do {
                if op.type == "const" {
                    guard let output = op.outputs.first, let value = op.attributes["val"] else {
                        throw KernelError("a const op without an output or a value")
                    }
                    let tensor = try constant(value, type: output.tensorType)
                    constantValues[output.name] = tensor
                    constantBlobs[output.name] = value.blob
                    constants.append((slot(output.name), tensor))
                    continue
                }
                if let decompress = decompressors[op.type] {
                    // The blobs behind each input, while every input has one.
                    var sources: [String: [MILBlobReference]]? = [:]
                    let arguments = try op.inputs.reduce(into: [String: [ArgumentItem]]()) { result, input in
                        result[input.name] = try input.arguments.map { binding -> ArgumentItem in
                            let blob: MILBlobReference?
                            let item: ArgumentItem
                            switch binding {
                            case .name(let value):
                                guard let tensor = constantValues[value] else { throw KernelError("\(op.type) reads \(value), which is not a constant") }
                                (blob, item) = (constantBlobs[value], .value(tensor))
                            case .value(let value):
                                (blob, item) = (value.blob, .value(try constant(value, type: nil)))
                            case .unset:
                                throw KernelError("an unset argument")
                            }
                            if let blob = blob { sources?[input.name, default: []].append(blob) } else { sources = nil }
                            return item
                        }
                    }
                    guard let output = op.outputs.first, let type = output.tensorType, let elementType = ElementType(type.dataType) else {
                        throw KernelError("\(op.type) without a tensor output")
                    }
                    let declaredShape = type.shape.map { $0.map(Int.init) }
                    let key = declaredShape.flatMap { shape in
                        sources.map { WeightStore.DecompressionKey(op: op.type, inputs: $0, type: elementType, shape: shape) }
                    }
                    let tensor = try weights.decompressed(key) {
                        guard var tensor = try decompress(OpArguments(arguments: arguments, frame: Frame(count: 0), states: nil)).first else {
                            throw KernelError("\(op.type) produced nothing")
                        }
                        guard declaredShape == tensor.shape else {
                            throw KernelError("decompressed to shape \(tensor.shape), the program declares \(type.shape ?? [])")
                        }
                        tensor.convert(to: elementType)
                        if elementType == .float16 {
                            // Keep decompressed weights as fp16, as the device does.
                            tensor = Tensor(shape: tensor.shape, type: .float16,
                                            data: .half(HalfStorage(bits: tensor.floats().map { Half.fromFloat($0) })))
                        }
                        return tensor
                    }
                    constantValues[output.name] = tensor
                    constants.append((slot(output.name), tensor))
                    continue
                }
            } catch let error as KernelError {
                throw InterpreterError.opFailed(function: name, op: "\(op.type) \(opName)", reason: error.reason)
            } catch let error as InterpreterError {
                throw error
            }
            guard let kernel = kernels[op.type] else {
                if !unsupported.contains(where: { $0.hasPrefix(op.type + " ") }) {
                    unsupported.append("\(op.type) (op \(opName))")
                }
                // Its outputs still get slots, so that the ops reading them do not fail first:
                // the whole list of unknown op types is the error.
                for output in op.outputs { _ = slot(output.name) }
                continue
            }
            var arguments: [String: [ArgumentItem]] = [:]
            for input in op.inputs {
                arguments[input.name] = try input.arguments.map { binding -> ArgumentItem in
                    switch binding {
                    case .name(let value):
                        if stateNames.contains(value) { return .state(value) }
                        guard let existing = slots[value] else {
                            throw InterpreterError.badProgram(function: name, reason: "op \(opName) reads \(value) before anything defines it")
                        }
                        return .slot(existing)
                    case .value(let value):
                        do {
                            return .value(try constant(value, type: nil))
                        } catch let error as KernelError {
                            throw InterpreterError.opFailed(function: name, op: "\(op.type) \(opName)", reason: error.reason)
                        }
                    case .unset:
                        throw InterpreterError.badProgram(function: name, reason: "op \(opName) has an unset argument \(input.name)")
                    }
                }
            }
            var outputSpecs: [(type: ElementType, shape: [Int]?)] = []
            for output in op.outputs {
                guard let tensor = output.tensorType, let type = ElementType(tensor.dataType) else {
                    throw InterpreterError.badProgram(function: name, reason: "op \(opName) has a non-tensor output \(output.name)")
                }
                outputSpecs.append((type, tensor.shape?.map(Int.init)))
            }
            var compiled = CompiledOp(type: op.type, name: opName, kernel: kernel, arguments: arguments,
                                      outputSlots: op.outputs.map { slot($0.name) }, outputSpecs: outputSpecs)
            for input in op.inputs {
                for case .name(let value) in input.arguments where value.hasPrefix("p_") && constantValues[value] != nil {
                    compiled.weights.append(value)
                }
            }
            operations.append(compiled)
        }
        if !unsupported.isEmpty {
            throw InterpreterError.unsupportedOps(function: name, ops: unsupported)
        }
        var outputs: [ValueSpec] = []
        var outputSlots: [Int] = []
        for output in block.outputs {
            guard let index = slots[output], let type = declared[output], let elementType = ElementType(type.dataType) else {
                throw InterpreterError.badProgram(function: name, reason: "output \(output) is not defined by any op")
            }
            outputs.append(ValueSpec(name: output, type: elementType, shape: type.shape?.map(Int.init) ?? []))
            outputSlots.append(index)
        }
        // Free each intermediate after its last reader; constants, inputs and outputs stay.
        var lastUse: [Int: Int] = [:]
        for (index, op) in operations.enumerated() {
            for items in op.arguments.values {
                for case .slot(let slot) in items { lastUse[slot] = index }
            }
        }
        let kept = Set(constants.map(\.slot)).union(outputSlots)
        for (slot, index) in lastUse where !kept.contains(slot) {
            operations[index].releases.append(slot)
        }
        Self.planInPlaceUpdates(&operations)
        self.outputs = outputs
        self.outputSlots = outputSlots
        self.constants = constants
        self.operations = operations
        self.slotCount = slots.count
    }

    /// Marks the `slice_update`s that may write their `x` in place: those that are its last
    /// reader. When that `x` is a `read_state` result and the state's next access after the
    /// write is a state write (a saved program writes a state with `write_state`, then reads
    /// it again with a fresh `read_state`), the store hands its reference over too, so the
    /// value is unique and a chain of per-layer writes into a KV state copies nothing: the
    /// interpreter's cost of a write is its update's size, as on a device that updates states
    /// in place (docs/kv-write.md). Nothing reads the store's husk in between.
    static func planInPlaceUpdates(_ operations: inout [CompiledOp]) {
        var stateOfSlot: [Int: String] = [:]  // read_state result -> its state
        var accesses: [String: [(index: Int, writes: Bool)]] = [:]  // state -> its ops, in order
        for (index, op) in operations.enumerated() {
            guard case .state(let state)? = (op.arguments["input"] ?? op.arguments["state"])?.first else { continue }
            if op.type == "read_state" {
                for slot in op.outputSlots { stateOfSlot[slot] = state }
                accesses[state, default: []].append((index, false))
            } else if op.type == "coreml_update_state" || op.type == "write_state" {
                accesses[state, default: []].append((index, true))
            }
        }
        for index in operations.indices where operations[index].type == "slice_update" {
            guard case .slot(let x)? = operations[index].arguments["x"]?.first,
                  operations[index].releases.contains(x) else { continue }
            operations[index].consumesX = x
            if let state = stateOfSlot[x],
               let next = accesses[state]?.first(where: { $0.index > index }), next.writes {
                operations[index].consumesState = state
            }
        }
    }

    /// Runs the function. Inputs are converted to their declared types and must have their
    /// declared shapes; `states` must hold every state the function declares and is updated in
    /// place by the program's state writes.
    public func run(inputs given: [String: Tensor], states: StateStore) throws -> [String: Tensor] {
        let frame = Frame(count: slotCount)
        for (slot, tensor) in constants { frame.slots[slot] = tensor }
        let expected = Set(inputs.map(\.name))
        if let unknown = given.keys.first(where: { !expected.contains($0) }) {
            throw InterpreterError.badInput(function: name, name: unknown, reason: "the function has no such input; it takes \(inputs.map(\.name).joined(separator: ", "))")
        }
        for (spec, slot) in zip(inputs, inputSlots) {
            guard let value = given[spec.name] else {
                throw InterpreterError.badInput(function: name, name: spec.name, reason: "missing")
            }
            guard value.shape == spec.shape else {
                throw InterpreterError.badInput(function: name, name: spec.name, reason: "shape \(value.shape), the function takes \(spec.shape)")
            }
            frame.slots[slot] = value.converted(to: spec.type)
        }
        for spec in self.states {
            guard let value = states.values[spec.name] else {
                throw InterpreterError.badState(function: name, name: spec.name, reason: "missing from the state passed in")
            }
            guard value.shape == spec.shape, value.type == spec.type else {
                throw InterpreterError.badState(function: name, name: spec.name, reason: "\(value), the function declares \(spec.type)\(spec.shape)")
            }
        }
        // States whose value the store handed to an in-place write and has not had back.
        var lent: [String: ValueSpec] = [:]
        defer {
            // After a failure part-way, a lent state gets zeros rather than staying a husk.
            for (state, spec) in lent where states.values[state]?.isHusk ?? true {
                states.values[state] = Tensor(shape: spec.shape, type: spec.type,
                                              data: .float([Float](repeating: 0, count: elementCount(spec.shape))))
            }
        }
        for (position, op) in operations.enumerated() {
            let started = profiling ? DispatchTime.now().uptimeNanoseconds : 0
            var results: [Tensor]
            do {
                let arguments = OpArguments(arguments: op.arguments, frame: frame, states: states,
                                            outputTypes: op.outputSpecs.map(\.type))
                if let x = op.consumesX, frame.slots[x] != nil {
                    // No local binding may keep a second reference to the value moved below:
                    // it would make the kernel's write copy the whole tensor.
                    if let state = op.consumesState, states.values[state] != nil,
                       let spec = self.states.first(where: { $0.name == state }) {
                        // A husk keeps the shape and type coreml_update_state checks against
                        // (the state's, as checked above).
                        states.values[state] = Tensor(shape: spec.shape, type: spec.type, data: .float([]))
                        lent[state] = spec
                    }
                    arguments.owned.values["x"] = frame.take(x)
                }
                results = try op.kernel(arguments)
            } catch let error as KernelError {
                throw InterpreterError.opFailed(function: name, op: "\(op.type) \(op.name)", reason: error.reason)
            }
            guard results.count == op.outputSlots.count else {
                throw InterpreterError.opFailed(function: name, op: "\(op.type) \(op.name)",
                                                reason: "produced \(results.count) values for \(op.outputSlots.count) outputs")
            }
            for index in results.indices {
                let spec = op.outputSpecs[index]
                if let shape = spec.shape, shape != results[index].shape {
                    throw InterpreterError.opFailed(function: name, op: "\(op.type) \(op.name)",
                                                    reason: "produced shape \(results[index].shape), the program declares \(shape)")
                }
                results[index].convert(to: spec.type)
                if !Self.movesOnly.contains(op.type), !results[index].isFinite {
                    throw InterpreterError.nonFinite(function: name, op: "\(op.type) (op \(op.name))",
                                                     nearestWeight: nearestWeight(to: position))
                }
                frame.slots[op.outputSlots[index]] = results[index]
            }
            for slot in op.releases { frame.slots[slot] = nil }
            if profiling {
                // The whole step: the kernel, its results' conversions and finiteness checks.
                opSeconds[op.type, default: 0] += Double(DispatchTime.now().uptimeNanoseconds - started) / 1e9
            }
        }
        var result: [String: Tensor] = [:]
        for (spec, slot) in zip(outputs, outputSlots) {
            result[spec.name] = frame.slots[slot]
        }
        return result
    }

    /// Ops whose results only move their inputs' elements. Their results are finite when their
    /// inputs are, and those were checked as the results that made them, so they are not
    /// scanned again: that scan would cost a whole state (or, for a view, the tensor it views)
    /// per state read, per layer read and per write. A non-finite value that enters from
    /// outside (a state the caller wrote, a float input) is still caught, at the first op that
    /// computes with it.
    static let movesOnly: Set<String> = [
        "read_state", "slice_update", "slice_by_index", "slice_by_size", "reshape", "squeeze",
        "expand_dims", "identity", "transpose",
    ]

    /// The first named weight read by the op nearest to operation `position` (earlier ops first
    /// on a tie): the same rule as the numpy interpreter's, so both name the same layer.
    func nearestWeight(to position: Int) -> String? {
        let order = operations.indices.sorted { (abs($0 - position), $0) < (abs($1 - position), $1) }
        return order.lazy.compactMap { self.operations[$0].weights.first }.first
    }
}

final class Frame {
    var slots: [Tensor?]
    init(count: Int) { slots = [Tensor?](repeating: nil, count: count) }

    /// The value of `slot`, moved out: the frame keeps no reference to it.
    func take(_ slot: Int) -> Tensor? {
        defer { slots[slot] = nil }
        return slots[slot]
    }
}

/// Values moved out of the frame for one op (`CompiledOp.consumesX`). A class, so that the
/// kernel's `takeTensor` removes the one reference rather than copying it.
final class MovedValues {
    var values: [String: Tensor] = [:]
}

typealias Kernel = (OpArguments) throws -> [Tensor]

/// An op's arguments by parameter name, as kernels read them.
struct OpArguments {
    let arguments: [String: [ArgumentItem]]
    let frame: Frame
    let states: StateStore?
    var outputTypes: [ElementType] = []
    /// Values moved out of the frame for this op alone (`CompiledOp.consumesX`).
    let owned = MovedValues()

    /// Input `name`, moved to the kernel when the op is its last reader (then the caller holds
    /// the only reference, and updating it in place copies nothing), else as `tensor(name)`.
    func takeTensor(_ name: String) throws -> Tensor {
        if let value = owned.values.removeValue(forKey: name) { return value }
        return try tensor(name)
    }

    private func resolve(_ item: ArgumentItem) throws -> Tensor {
        switch item {
        case .slot(let slot):
            guard let tensor = frame.slots[slot] else { throw KernelError("reads a value that was freed or never set") }
            return tensor
        case .value(let tensor):
            return tensor
        case .state(let name):
            throw KernelError("reads state \(name) outside read_state/coreml_update_state")
        }
    }

    func has(_ name: String) -> Bool { arguments[name]?.isEmpty == false }

    func tensor(_ name: String) throws -> Tensor {
        guard let items = arguments[name], let first = items.first else { throw KernelError("missing input \(name)") }
        return try resolve(first)
    }

    func optional(_ name: String) throws -> Tensor? {
        guard let items = arguments[name], let first = items.first else { return nil }
        return try resolve(first)
    }

    func list(_ name: String) throws -> [Tensor] {
        guard let items = arguments[name] else { throw KernelError("missing input \(name)") }
        return try items.map(resolve)
    }

    func int(_ name: String, default fallback: Int? = nil) throws -> Int {
        guard let tensor = try optional(name) else {
            guard let fallback = fallback else { throw KernelError("missing input \(name)") }
            return fallback
        }
        guard let first = tensor.ints().first, tensor.count == 1 else { throw KernelError("input \(name) is not a scalar") }
        return Int(first)
    }

    func ints(_ name: String) throws -> [Int] {
        try tensor(name).ints().map(Int.init)
    }

    func optionalInts(_ name: String) throws -> [Int]? {
        try optional(name)?.ints().map(Int.init)
    }

    func bool(_ name: String, default fallback: Bool = false) throws -> Bool {
        guard let tensor = try optional(name) else { return fallback }
        return tensor.bools().first ?? fallback
    }

    func optionalBools(_ name: String) throws -> [Bool]? {
        try optional(name)?.bools()
    }

    func float(_ name: String, default fallback: Float) throws -> Float {
        guard let tensor = try optional(name) else { return fallback }
        return tensor.floats().first ?? fallback
    }

    func string(_ name: String) throws -> String? {
        try optional(name)?.strings?.first
    }

    func stateName(_ name: String) throws -> String {
        guard let items = arguments[name], let first = items.first, case .state(let state) = first else {
            throw KernelError("input \(name) is not a state")
        }
        return state
    }
}
