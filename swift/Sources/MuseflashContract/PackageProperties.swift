import ExportMetadata
import MLPackage

/// Properties every package has, whatever its role.
extension LoadedBundle {
    /// What the metadata's state entries for a role must satisfy beyond their
    /// own shape, from the model settings of the same metadata.
    private struct StateExpectations {
        var kvHeads: Int?
        var headDim: Int?
        var slidingWindow: Int?
        /// State kind -> layer count.
        var layers: [String: Int] = [:]
        var source: String
    }

    private func stateExpectations(for role: String) -> StateExpectations {
        switch role {
        case ExportMetadata.AssetRole.target:
            let target = metadata.target
            let count = { (type: String) in target.layerTypes.filter { $0 == type }.count }
            return StateExpectations(
                kvHeads: target.numKeyValueHeads, headDim: target.headDim, slidingWindow: target.slidingWindow,
                layers: [ExportMetadata.StateKind.slidingKV: count(ExportMetadata.LayerType.slidingAttention),
                         ExportMetadata.StateKind.globalKV: count(ExportMetadata.LayerType.fullAttention)],
                source: "target")
        case ExportMetadata.AssetRole.dflashDrafter, ExportMetadata.AssetRole.ringDrafter:
            guard let drafter = metadata.speculativeDecoding?.drafter else {
                return StateExpectations(source: "speculative_decoding.drafter (absent)")
            }
            return StateExpectations(
                kvHeads: drafter.numKeyValueHeads, headDim: drafter.headDim, slidingWindow: drafter.slidingWindow,
                layers: [ExportMetadata.StateKind.slidingKV: drafter.numHiddenLayers,
                         ExportMetadata.StateKind.globalKV: drafter.numHiddenLayers],
                source: "speculative_decoding.drafter")
        default:
            return StateExpectations(source: "nothing (unknown role)")
        }
    }

    func states(_ role: String) -> PropertyResult {
        evaluate("\(role).states") {
            let package = try package(role)
            let entries = metadata.assets[role]?.states ?? []
            let expectations = stateExpectations(for: role)
            var problems = Problems()
            if expectations.kvHeads == nil, role != ExportMetadata.AssetRole.target,
               metadata.speculativeDecoding == nil, !entries.isEmpty {
                problems.add("metadata.json has no speculative_decoding.drafter to check the states against")
            }

            for entry in entries {
                checkEntry(entry, against: expectations, problems: &problems)
            }

            let expectedNames = entries.map(\.name).sorted()
            for function in package.functions {
                let names = function.states.map(\.name).sorted()
                problems.require(names == expectedNames,
                                 "function \(function.name) binds states \(names) but metadata lists \(expectedNames)")
                for state in function.states {
                    guard let entry = entries.first(where: { $0.name == state.name }) else { continue }
                    guard case .state(let array?) = state.type else {
                        problems.add("\(function.name).\(state.name) is \(describe(state.type)), not a state array")
                        continue
                    }
                    problems.require(array.shape == entry.shape.map(Int64.init),
                                     "\(function.name).\(state.name) has shape \(describe(array.shape)) but metadata says \(entry.shape)")
                    problems.require(array.dataType == .float16,
                                     "\(function.name).\(state.name) is \(array.dataType.shortName), not fp16")
                }
            }
            let summary = entries.map { "\($0.name) \($0.shape)" }.joined(separator: ", ")
            return try problems.verdict(entries.isEmpty ? "no states" : summary)
        }
    }

    private func checkEntry(_ entry: ExportMetadata.State, against expected: StateExpectations, problems: inout Problems) {
        let label = "metadata state \(entry.name)"
        problems.require(entry.dtype == "float16", "\(label) has dtype \(entry.dtype), not float16")
        let dimensions = [entry.layers, entry.kvHeads, entry.capacity, entry.headDim]
        problems.require(kvDimensions(entry.shape) == dimensions,
                         "\(label) shape \(entry.shape) is not [layers, kv_heads, capacity, head_dim] = \(dimensions) "
                         + "(optionally after leading 1s)")
        if let kvHeads = expected.kvHeads {
            problems.require(entry.kvHeads == kvHeads,
                             "\(label) kv_heads \(entry.kvHeads) != \(expected.source).num_key_value_heads \(kvHeads)")
        }
        if let headDim = expected.headDim {
            problems.require(entry.headDim == headDim, "\(label) head_dim \(entry.headDim) != \(expected.source).head_dim \(headDim)")
        }
        if let layers = expected.layers[entry.kind] {
            let key = expected.source == "target" ? "the number of matching target.layer_types" : "\(expected.source).num_hidden_layers"
            problems.require(entry.layers == layers, "\(label) layers \(entry.layers) != \(key) \(layers)")
        }
        switch entry.kind {
        case ExportMetadata.StateKind.slidingKV:
            if let window = expected.slidingWindow {
                problems.require(entry.capacity >= window,
                                 "\(label) capacity \(entry.capacity) < \(expected.source).sliding_window \(window)")
            }
        case ExportMetadata.StateKind.globalKV:
            problems.require(entry.capacity == metadata.contextLength,
                             "\(label) capacity \(entry.capacity) != context_length \(metadata.contextLength)")
        default:
            problems.add("\(label) has kind \(entry.kind), neither global_kv nor sliding_kv")
        }
    }

    func functionMap(_ role: String) -> PropertyResult {
        evaluate("\(role).function_map") {
            let package = try package(role)
            guard let asset = metadata.assets[role] else { return "no asset" }
            var problems = Problems()
            problems.require(package.defaultFunctionName == asset.defaultFunction,
                             "default function is \"\(package.defaultFunctionName)\" but metadata says \"\(asset.defaultFunction)\"")
            for (name, expected) in asset.functions.sorted(by: { $0.key < $1.key }) {
                guard let function = package.function(named: name) else {
                    problems.add("metadata lists function \(name) but the package has \(package.functionNames)")
                    continue
                }
                let inputs = function.inputs.map(\.name)
                let outputs = function.outputs.map(\.name)
                problems.require(inputs.sorted() == expected.inputs.sorted(),
                                 "\(name) inputs are \(inputs) but metadata says \(expected.inputs)")
                problems.require(outputs.sorted() == expected.outputs.sorted(),
                                 "\(name) outputs are \(outputs) but metadata says \(expected.outputs)")
            }
            return try problems.verdict(asset.functions.keys.sorted().joined(separator: ", "))
        }
    }
}
