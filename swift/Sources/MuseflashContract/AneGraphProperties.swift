import MLPackage

/// One function of a package's ML program, as the audit's graph rules read it, indexed once.
struct ProgramFunction {
    var label: String
    var function: MILFunction
    var block: MILBlock
    var index: GraphIndex

    init(label: String, function: MILFunction, block: MILBlock) {
        self.label = label
        self.function = function
        self.block = block
        self.index = GraphIndex(function: function, block: block)
    }
}

/// A block's operations in order, which operation produces each value, and the values' types.
struct GraphIndex {
    let operations: [MILOperation]
    /// Value name -> index in `operations` of the operation that produces it.
    let producer: [String: Int]
    let types: [String: MILTensorType]

    init(function: MILFunction, block: MILBlock) {
        operations = block.allOperations
        var producer: [String: Int] = [:]
        var types: [String: MILTensorType] = [:]
        for (index, operation) in operations.enumerated() {
            for output in operation.outputs {
                producer[output.name] = index
                if let type = output.tensorType { types[output.name] = type }
            }
        }
        for input in function.inputs + block.inputs {
            if let tensor = input.tensorType { types[input.name] = tensor }
        }
        self.producer = producer
        self.types = types
    }

    func producerOperation(_ name: String) -> MILOperation? {
        producer[name].map { operations[$0] }
    }
}

extension MILOperation {
    /// The value name bound to parameter `name`, when it is bound by name.
    func boundName(_ name: String) -> String? {
        if case .name(let value)? = input(named: name)?.first { return value }
        return nil
    }
}

/// A write of a state: a `write_state` (how coremltools saves `coreml_update_state`) or an
/// unsaved `coreml_update_state`.
struct StateWrite {
    var index: Int
    var state: String
    /// The value written.
    var source: String

    static func all(in graph: GraphIndex) -> [StateWrite] {
        graph.operations.enumerated().compactMap { index, operation in
            switch operation.type {
            case "write_state":
                guard let state = operation.boundName("input"), let source = operation.boundName("data") else { return nil }
                return StateWrite(index: index, state: state, source: source)
            case "coreml_update_state":
                guard let state = operation.boundName("state"), let source = operation.boundName("value") else { return nil }
                return StateWrite(index: index, state: state, source: source)
            default:
                return nil
            }
        }
    }
}

extension LoadedBundle {
    /// Ops that only re-address or re-type their `x`.
    static let passThroughOps: Set<String> = ["reshape", "identity", "expand_dims", "squeeze", "cast", "transpose"]
    static let compareOps: Set<String> = ["equal", "not_equal", "greater", "greater_equal", "less", "less_equal"]
    static let gatherOps: Set<String> = ["gather", "gather_along_axis", "gather_nd"]
    /// What a blend is computed with: `select` (where) or a mul-add.
    static let blendOps: Set<String> = ["select", "add", "sub", "mul"]
    /// Ops that take a part of their `x` (or, `slice_update`, write into it).
    static let viewOps: Set<String> = ["slice_by_index", "slice_by_size", "slice_update"]

    // MARK: KV writes

    enum WriteKind: String, CaseIterable {
        /// `slice_update`s of rows into the state (Anemll's and CoreML-LLM's pattern).
        case slice
        /// Old contents mixed with new ones by a select or mul-add over runtime compares.
        case blend
        /// The state written back as read.
        case copy
        /// Anything else.
        case other
    }

    /// What feeds `write`: the chain of `slice_update`s from the state's value and their
    /// updates, through ops that only re-address, or a tensor computed whole.
    static func kind(of write: StateWrite, in graph: GraphIndex) -> WriteKind {
        var current = write.source
        var pieces: [String] = []
        var sliced = false
        var computedWhole = false
        var steps = 0
        while steps < graph.operations.count + 1 {
            steps += 1
            guard let operation = graph.producerOperation(current) else {
                computedWhole = true  // a function input written as the state
                break
            }
            if passThroughOps.contains(operation.type), let x = operation.boundName("x") {
                current = x
            } else if operation.type == "slice_update", let x = operation.boundName("x") {
                sliced = true
                if let update = operation.boundName("update") { pieces.append(update) }
                current = x
            } else if operation.type == "read_state", operation.boundName("input") == write.state {
                break
            } else {
                computedWhole = true
                pieces.append(current)
                break
            }
        }
        if pieces.contains(where: { isBlend($0, state: write.state, in: graph) }) { return .blend }
        if computedWhole { return .other }
        return sliced ? .slice : .copy
    }

    /// `value` is a blend: new values mixed with the state's old ones under a runtime mask, as a
    /// `select` (where) of a view of the state, or a mul-add with one, whose mask comes from a
    /// compare. Rows written at a position never read the old contents they replace.
    static func isBlend(_ value: String, state: String, in graph: GraphIndex) -> Bool {
        guard let operation = graph.producerOperation(skippingPassThrough(value, in: graph)),
              blendOps.contains(operation.type) else { return false }
        let operands = ["x", "y", "a", "b"].compactMap(operation.boundName)
        let mixesOld = operands.contains { operand in
            if isView(operand, of: state, in: graph) { return true }
            // A mul-add: the old contents scaled by a mask, added to the new ones.
            guard let product = graph.producerOperation(skippingPassThrough(operand, in: graph)),
                  product.type == "mul" else { return false }
            return ["x", "y"].compactMap(product.boundName).contains { isView($0, of: state, in: graph) }
        }
        return mixesOld && dependsOnCompare(operation, in: graph)
    }

    static func skippingPassThrough(_ value: String, in graph: GraphIndex) -> String {
        var current = value
        var steps = 0
        while steps < graph.operations.count, let operation = graph.producerOperation(current),
              passThroughOps.contains(operation.type), let x = operation.boundName("x") {
            current = x
            steps += 1
        }
        return current
    }

    /// `value` is the state's contents, or a part of them, as read (through slices, re-addressing
    /// and earlier writes of it).
    static func isView(_ value: String, of state: String, in graph: GraphIndex) -> Bool {
        var current = value
        var steps = 0
        while steps < graph.operations.count, let operation = graph.producerOperation(current) {
            steps += 1
            if operation.type == "read_state" { return operation.boundName("input") == state }
            guard passThroughOps.contains(operation.type) || viewOps.contains(operation.type),
                  let x = operation.boundName("x") else { return false }
            current = x
        }
        return false
    }

    /// Whether a compare op is among what `operation` is computed from (bounded search).
    static func dependsOnCompare(_ operation: MILOperation, in graph: GraphIndex, limit: Int = 4096) -> Bool {
        var pending = operation.inputs.flatMap(\.arguments).compactMap { binding -> String? in
            if case .name(let name) = binding { return name }
            return nil
        }
        var seen = Set<String>()
        while let name = pending.popLast(), seen.count < limit {
            guard seen.insert(name).inserted, let producer = graph.producerOperation(name) else { continue }
            if compareOps.contains(producer.type) { return true }
            for argument in producer.inputs.flatMap(\.arguments) {
                if case .name(let next) = argument { pending.append(next) }
            }
        }
        return false
    }

    static func kvWriteFinding(_ graphs: [ProgramFunction]) -> AuditFinding {
        var totals: [WriteKind: Int] = [:]
        var perFunction: [(String, String)] = []
        for graph in graphs {
            let index = graph.index
            let writes = StateWrite.all(in: index)
            guard !writes.isEmpty else { continue }
            var kinds: [WriteKind: [String]] = [:]
            for write in writes {
                let kind = kind(of: write, in: index)
                kinds[kind, default: []].append(write.state)
                totals[kind, default: 0] += 1
            }
            perFunction.append((graph.label, WriteKind.allCases.compactMap { kind in
                kinds[kind].map { "\(kind) \($0.count) (\($0.joined(separator: ", ")))" }
            }.joined(separator: ", ")))
        }
        let blends = totals[.blend] ?? 0
        let all = totals.values.reduce(0, +)
        let detail = perFunction.isEmpty ? "no function writes a state"
            : grouped(perFunction) + "; a blend FAILs on the Neural Engine, a slice WARNs on gpu (docs/kv-write.md)"
        return AuditFinding(rule: .kvWrite, value: Int64(blends), figure: "\(blends) of \(all) writes are blends",
                            detail: detail,
                            statuses: [.iphone: blends > 0 ? .fail : (totals[.other] ?? 0) > 0 ? .warn : .pass,
                                       .mac: blends > 0 ? .fail : (totals[.other] ?? 0) > 0 ? .warn : .pass,
                                       .gpu: (totals[.slice] ?? 0) > 0 ? .warn : .pass])
    }

    // MARK: Converter bugs

    /// A `read_state` of a state after a write of it in the same function, other than the one
    /// coremltools saves right after each `write_state` as the update's result.
    static func readAfterWriteFinding(_ graphs: [ProgramFunction]) -> AuditFinding {
        var found: [(String, String)] = []
        var count = 0
        for graph in graphs {
            let index = graph.index
            let writes = Dictionary(StateWrite.all(in: index).map { ($0.index, $0) }) { first, _ in first }
            var written = Set<String>()
            var reread: [String] = []
            for (position, operation) in index.operations.enumerated() {
                if let write = writes[position] {
                    written.insert(write.state)
                    continue
                }
                guard operation.type == "read_state", let state = operation.boundName("input"), written.contains(state) else { continue }
                let previous = position > 0 ? index.operations[position - 1] : nil
                let isUpdateResult = previous?.type == "write_state" && previous?.boundName("input") == state
                if !isUpdateResult { reread.append(state) }
            }
            if !reread.isEmpty {
                count += reread.count
                found.append((graph.label, reread.joined(separator: ", ")))
            }
        }
        let detail = found.isEmpty ? "no function reads a state again after writing it"
            : grouped(found) + " read again after a write (remove_redundant_ops may merge the reads)"
        return AuditFinding(rule: .readAfterWrite, value: Int64(count), figure: "\(count) re-reads", detail: detail,
                            status: count > 0 ? .fail : .pass)
    }

    /// A function output that is the value a state write takes.
    static func outputWriteSourceFinding(_ graphs: [ProgramFunction]) -> AuditFinding {
        var found: [(String, String)] = []
        for graph in graphs {
            let outputs = Set(graph.block.outputs)
            let sources = StateWrite.all(in: graph.index).filter { outputs.contains($0.source) }
            if !sources.isEmpty {
                found.append((graph.label, sources.map { "\($0.source) (written to \($0.state))" }.joined(separator: ", ")))
            }
        }
        let detail = found.isEmpty ? "no output is the value of a state write"
            : grouped(found) + " is an output (a load-time crash)"
        return AuditFinding(rule: .outputWriteSource, value: Int64(found.count), figure: "\(found.count) functions",
                            detail: detail, status: found.isEmpty ? .pass : .fail)
    }

    // MARK: Shapes and ops

    /// Every tensor an op computes (`const` ops' values excluded; constexpr ops' dense weights
    /// included), with the function inputs.
    private static func computedTensors(_ graph: ProgramFunction, _ index: GraphIndex)
        -> [(type: String, name: String, tensor: MILTensorType)] {
        let inputs = graph.function.inputs.compactMap { input in input.tensorType.map { ("input", input.name, $0) } }
        return inputs + index.operations.filter { $0.type != "const" }.flatMap { operation in
            operation.outputs.compactMap { output in output.tensorType.map { (operation.type, output.name, $0) } }
        }
    }

    static func tensorCount(_ count: Int) -> String {
        count == 1 ? "1 tensor" : "\(count) tensors"
    }

    static func shapeText(_ tensor: MILTensorType) -> String {
        "[" + tensor.dimensions.map { dimension -> String in
            if case .constant(let size) = dimension { return String(size) }
            return "?"
        }.joined(separator: ", ") + "]"
    }

    static func rankFinding(_ graphs: [ProgramFunction]) -> AuditFinding {
        var highest = 0
        var example = ""
        var perFunction: [(String, String)] = []
        for graph in graphs {
            let tensors = computedTensors(graph, graph.index)
            let high = tensors.filter { $0.tensor.dimensions.count > 4 }
            for tensor in tensors where tensor.tensor.dimensions.count > highest {
                highest = tensor.tensor.dimensions.count
                example = "\(graph.label) \(tensor.type) \(tensor.name) \(shapeText(tensor.tensor))"
            }
            if !high.isEmpty { perFunction.append((graph.label, tensorCount(high.count) + " of rank 5 or more")) }
        }
        let detail = perFunction.isEmpty ? "every tensor of rank 4 or less" + (example.isEmpty ? "" : " (e.g. \(example))")
            : grouped(perFunction) + "; highest: \(example)"
        return AuditFinding(rule: .rank, value: Int64(highest), figure: "highest rank \(highest)", detail: detail,
                            status: highest > 4 ? .fail : .pass)
    }

    /// The op kinds the Neural Engine leaves to the CPU, by function.
    static func cpuOpsFinding(_ graphs: [ProgramFunction]) -> AuditFinding {
        var most = 0
        var perFunction: [(String, String)] = []
        for graph in graphs {
            let index = graph.index
            var counts: [String: Int] = [:]
            for operation in index.operations {
                let outputType = operation.outputs.first?.tensorType?.dataType
                let integer = outputType.map(isInteger) ?? false
                let category: String?
                switch operation.type {
                case let type where gatherOps.contains(type): category = "gather"
                case let type where compareOps.contains(type): category = "compare"
                case "cast" where integer: category = "integer cast"
                case "select" where integer: category = "integer select"
                case "reduce_argmax": category = "argmax"
                case "while_loop": category = "loop"
                default: category = nil
                }
                if let category = category { counts[category, default: 0] += 1 }
            }
            let total = counts.values.reduce(0, +)
            most = max(most, total)
            if total > 0 {
                perFunction.append((graph.label, ["gather", "integer cast", "compare", "integer select", "argmax", "loop"]
                    .compactMap { key in counts[key].map { "\(key) \($0)" } }.joined(separator: ", ")))
            }
        }
        let detail = perFunction.isEmpty ? "no gather, integer cast, compare, integer select, argmax or loop" : grouped(perFunction)
        return AuditFinding(rule: .cpuOps, value: Int64(most), figure: "up to \(most) a function", detail: detail,
                            status: most > 0 ? .warn : .pass)
    }

    static func isInteger(_ type: MILDataType) -> Bool {
        switch type {
        case .int4, .int8, .int16, .int32, .int64, .uint1, .uint2, .uint3, .uint4, .uint6, .uint8, .uint16, .uint32, .uint64:
            return true
        default:
            return false
        }
    }

    static let topkLimit: UInt64 = 65_536

    static func topkFinding(_ graphs: [ProgramFunction]) -> AuditFinding {
        var longest: UInt64 = 0
        var found: [(String, String)] = []
        for graph in graphs {
            let index = graph.index
            var lengths: [UInt64] = []
            for operation in index.operations where operation.type == "topk" {
                guard let x = operation.boundName("x"), let shape = index.types[x]?.shape, !shape.isEmpty else { continue }
                let axis = constantInts(operation.input(named: "axis")?.first, in: index)?.first ?? -1
                let position = axis < 0 ? shape.count + Int(axis) : Int(axis)
                lengths.append(position >= 0 && position < shape.count ? shape[position] : shape.max()!)
            }
            if let top = lengths.max() {
                longest = max(longest, top)
                found.append((graph.label, lengths.map(String.init).joined(separator: ", ")))
            }
        }
        let detail = found.isEmpty ? "no topk" : "topk over " + grouped(found)
            + "; indices wrap past \(topkLimit) (FAIL on the Neural Engine, WARN on gpu)"
        let over = longest > topkLimit
        return AuditFinding(rule: .topk, value: Int64(longest), figure: found.isEmpty ? "none" : "longest axis \(longest)",
                            detail: detail, statuses: [.iphone: over ? .fail : .pass, .mac: over ? .fail : .pass,
                                                       .gpu: over ? .warn : .pass])
    }

    /// The integers of a binding given inline or by a `const` op.
    static func constantInts(_ binding: MILBinding?, in graph: GraphIndex) -> [Int64]? {
        let value: MILValue?
        switch binding {
        case .value(let inline)?: value = inline
        case .name(let name)?:
            guard let operation = graph.producerOperation(name), operation.type == "const" else { return nil }
            value = operation.attributes["val"]
        default: value = nil
        }
        switch value?.immediateTensor {
        case .ints(let values)?: return values.map(Int64.init)
        case .longInts(let values)?: return values
        default: return nil
        }
    }

    static let largeDimension: UInt64 = 16_384

    static func largeDimensionsFinding(_ graphs: [ProgramFunction]) -> AuditFinding {
        var largest: UInt64 = 0
        var example = ""
        var perFunction: [(String, String)] = []
        for graph in graphs {
            let tensors = computedTensors(graph, graph.index)
            var above = 0
            for tensor in tensors {
                let size = tensor.tensor.shape?.max() ?? 0
                if size > largeDimension { above += 1 }
                if size > largest {
                    largest = size
                    example = "\(graph.label) \(tensor.type) \(tensor.name) \(shapeText(tensor.tensor))"
                }
            }
            if above > 0 { perFunction.append((graph.label, tensorCount(above))) }
        }
        let detail = perFunction.isEmpty ? "no dimension above \(largeDimension)" + (example.isEmpty ? "" : "; largest: \(example)")
            : "above \(largeDimension): " + grouped(perFunction) + "; largest: \(example) (an unproven limit, so a WARN)"
        return AuditFinding(rule: .largeDimensions, value: Int64(largest), figure: "largest \(largest)", detail: detail,
                            status: largest > largeDimension ? .warn : .pass)
    }
}
