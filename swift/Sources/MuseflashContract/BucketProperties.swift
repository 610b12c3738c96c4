import ExportMetadata
import MLPackage

/// `target.buckets` (and `<role>.buckets` for any other asset with buckets: a full-attention
/// DFlash drafter, whose ring is as long as the context): the asset's context buckets
/// (metadata.json `assets.<role>.buckets`, python/museflash/bundle.py `ContextBucket`) hold to
/// its graph.
///
/// A bucket of `c` slots has functions `<name>_<c>` (`main_64`, `prefill_64`) that compute what
/// the whole-capacity ones compute but attend to (and write) only slots [0, c) of the
/// context-sized caches: the target's global caches, another asset's states. The property fails
/// when metadata.json describes the buckets wrongly (`Asset.bucketProblem`: not ascending,
/// outside the capacity, a function that is not the asset's own), when the package has no
/// program for a bucket function, or when a function's reads of those caches do not match its
/// context, judged from the ML program itself:
///
/// A read is a `slice_by_index` that cuts a cache layer down on its capacity axis: its `x` is a
/// cache (as `read_state` reads it and `slice_update` updates it) or one layer of one, with
/// every slot, and its output keeps fewer slots. A bucket function of `c` slots reads at least
/// once per layer of the keys and of the values, and every read is slots [0, c); a
/// whole-capacity function has no such read. A bundle whose graph is not what its buckets say
/// would have its engine pick a function that attends to the wrong slots, so the mismatch fails
/// by function name.
extension LoadedBundle {
    func bucketProperties() -> [PropertyResult] {
        [buckets(.target)] + roles.filter { $0 != .target && metadata.assets[$0]?.buckets != nil }.map(buckets)
    }

    func buckets(_ role: AssetRole) -> PropertyResult {
        evaluate("\(role).buckets") {
            let package = try package(role)
            guard let asset = metadata.assets[role] else { return "no \(role) asset" }
            if let problem = asset.bucketProblem {
                throw Violation(detail: "metadata.json: \(problem); re-export with --context-buckets (multiples "
                                + "of 32 below the capacity), or use the metadata.json the export wrote")
            }
            let buckets = asset.buckets ?? []
            let contexts = buckets.map { String($0.context) }.joined(separator: ", ")
            // What a bucket slices: the target's global caches (not its sliding rings), or the
            // other asset's states.
            let caches = role == .target ? asset.states.filter { $0.kind == .globalKV } : asset.states
            let label = role == .target ? "the global caches" : "the \(role) caches"
            guard let program = package.program else {
                guard buckets.isEmpty else {
                    throw Violation(detail: "not an ML program: the functions of buckets \(contexts) have no graph to "
                                    + "hold to their contexts; re-export")
                }
                return "no buckets; not an ML program: no graph to judge"
            }
            var problems = Problems()
            var missing: [String] = []
            var mismatches: [String] = []
            for entry in asset.functionTable {
                guard let block = program.function(named: entry.name)?.block else {
                    // A whole-capacity function the package lacks is package.functions' and
                    // function_map's to report.
                    if entry.context != nil { missing.append(entry.name) }
                    continue
                }
                let reads = Self.cacheReads(in: block, states: caches)
                if let context = entry.context {
                    let wrong = reads.filter { $0.begin != 0 || $0.slots != context }
                    if !wrong.isEmpty {
                        mismatches.append("\(entry.name) reads slots \(Self.ranges(wrong)) of \(label), not [0, \(context))")
                    }
                    let unread = caches.flatMap { state in
                        (0..<state.layers).filter { layer in
                            !reads.contains { $0.state == state.name.rawValue && $0.layer == layer }
                        }.map { "\(state.name) layer \($0)" }
                    }
                    if !unread.isEmpty {
                        mismatches.append("\(entry.name) reads no [0, \(context)) slice of \(unread.joined(separator: ", "))")
                    }
                } else if !reads.isEmpty {
                    mismatches.append("\(entry.name) runs over the whole capacity but reads only slots "
                                      + "\(Self.ranges(reads)) of \(label)")
                }
            }
            if !missing.isEmpty {
                problems.add("the package has no program for \(missing.joined(separator: ", ")), which metadata.json's "
                             + "buckets list; re-export, or drop those buckets from metadata.json")
            }
            if !mismatches.isEmpty {
                problems.add(mismatches.joined(separator: "; ") + "; the buckets in metadata.json do not describe "
                             + "this graph: re-export, or use the metadata.json the export wrote")
            }
            let whole = asset.functionTable.filter { $0.context == nil }.map(\.name)
            let capacity = caches.first.map { "all \($0.capacity)" } ?? "all"
            guard !buckets.isEmpty else {
                return try problems.verdict(caches.isEmpty ? "no buckets (no context-sized caches)"
                                            : "no buckets: \(Self.list(whole)) read \(capacity) slots of \(label)")
            }
            let bucketed = ExportMetadata.FunctionName.allCases.filter { name in buckets.contains { $0.functions[name] != nil } }
            return try problems.verdict("buckets \(contexts): \(Self.list(bucketed.map(\.rawValue))) read "
                                        + buckets.map { String($0.context) }.joined(separator: "/") + " slots, "
                                        + "the whole-capacity \(Self.list(whole)) \(capacity)")
        }
    }

    /// A `slice_by_index` of a cache layer down to `slots` on its capacity axis.
    struct CacheRead: Equatable {
        /// The state's name.
        var state: String
        /// Its layer; nil when the graph does not say which.
        var layer: Int?
        /// The first slot; nil when computed at run time.
        var begin: Int?
        var slots: Int
    }

    /// The reads of `states` in `block`: `slice_by_index`es whose `x` is such a state as
    /// `read_state` reads it or `slice_update` updates it, or one layer of it (a `slice_by_index`
    /// of one layer with every slot), and whose output keeps fewer slots.
    static func cacheReads(in block: MILBlock, states: [ExportMetadata.State]) -> [CacheRead] {
        let operations = block.allOperations
        var constants: [String: MILValue] = [:]
        var shapes: [String: [UInt64]] = [:]
        for operation in operations {
            for output in operation.outputs { shapes[output.name] = output.tensorType?.shape }
            if operation.type == "const", let name = operation.outputs.first?.name {
                constants[name] = operation.attributes["val"]
            }
        }
        /// A constant integer (or bool) vector input, bound by name to a `const` op or inline.
        func integers(_ operation: MILOperation, _ input: String) -> [Int]? {
            let value: MILValue?
            switch operation.input(named: input)?.first {
            case .name(let name)?: value = constants[name]
            case .value(let inline)?: value = inline
            default: value = nil
            }
            switch value?.immediateTensor {
            case .ints(let values)?: return values.map(Int.init)
            case .longInts(let values)?: return values.map(Int.init)
            case .bools(let values)?: return values.map { $0 ? 1 : 0 }
            default: return nil
            }
        }
        /// Where `slice_by_index` starts on `axis` (0 under its begin mask); nil when not constant.
        func begin(_ operation: MILOperation, axis: Int) -> Int? {
            if let mask = integers(operation, "begin_mask"), mask.indices.contains(axis), mask[axis] != 0 { return 0 }
            guard let begin = integers(operation, "begin"), begin.indices.contains(axis) else { return nil }
            return begin[axis]
        }

        let cache = Dictionary(states.map { ($0.name.rawValue, $0) }, uniquingKeysWith: { first, _ in first })
        // Value name -> the state it is, and the layer when it is one layer of it.
        var origins: [String: (state: ExportMetadata.State, layer: Int?)] = [:]
        var reads: [CacheRead] = []
        for operation in operations {
            guard let output = operation.outputs.first?.name else { continue }
            switch operation.type {
            case "read_state":
                if case .name(let name)? = operation.input(named: "input")?.first, let state = cache[name] {
                    origins[output] = (state, nil)
                }
            case "slice_update":
                if case .name(let x)? = operation.input(named: "x")?.first, let origin = origins[x] {
                    origins[output] = origin
                }
            case "slice_by_index":
                guard case .name(let x)? = operation.input(named: "x")?.first, let origin = origins[x],
                      let input = shapes[x] ?? nil, let sliced = shapes[output] ?? nil,
                      input.count >= 2, sliced.count >= 2 else { continue }
                let capacity = UInt64(origin.state.capacity)
                // [..., capacity, head_dim] in, [..., slots, head_dim] out.
                guard input[input.count - 2] == capacity, sliced.last == input.last else { continue }
                var layer = origin.layer
                if layer == nil, input.count >= 4 {
                    // A slice of the whole state: one layer when it squeezes the layer axis or keeps 1.
                    let axis = input.count - 4
                    if sliced.count == input.count - 1 || (sliced.count == input.count && sliced[axis] == 1) {
                        layer = begin(operation, axis: axis)
                    }
                }
                let slots = sliced[sliced.count - 2]
                if slots < capacity {
                    reads.append(CacheRead(state: origin.state.name.rawValue, layer: layer,
                                                 begin: begin(operation, axis: input.count - 2), slots: Int(slots)))
                } else if layer != nil || sliced == input {
                    origins[output] = (origin.state, layer)
                }
            default:
                break
            }
        }
        return reads
    }

    /// `[0, 32)`, or `[0, 32), 16 from a run-time slot`, of distinct reads.
    static func ranges(_ reads: [CacheRead]) -> String {
        let texts = reads.map { read in
            read.begin.map { "[\($0), \($0 + read.slots))" } ?? "\(read.slots) from a run-time slot"
        }
        var seen = Set<String>()
        return texts.filter { seen.insert($0).inserted }.joined(separator: ", ")
    }

    /// `main`, `main and prefill`, `a, b and c`.
    static func list(_ names: [String]) -> String {
        guard names.count > 1 else { return names.first ?? "no function" }
        return names.dropLast().joined(separator: ", ") + " and " + names.last!
    }
}
