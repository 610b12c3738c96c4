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
        var layers: [StateKind: Int] = [:]
        /// Key path of the settings object the values come from.
        var source: String
        /// Where `layers` comes from, for messages.
        var layersSource = ""
    }

    private func stateExpectations(for role: AssetRole) -> StateExpectations {
        switch role {
        case .target:
            let target = metadata.target
            let count = { (type: LayerType) in target.layerTypes.filter { $0 == type }.count }
            return StateExpectations(
                kvHeads: target.numKeyValueHeads, headDim: target.headDim, slidingWindow: target.slidingWindow,
                layers: [.slidingKV: count(.slidingAttention), .globalKV: count(.fullAttention)],
                source: "target", layersSource: "the number of matching target.layer_types")
        case .dflashDrafter, .ringDrafter:
            guard let drafter = metadata.speculativeDecoding?.drafter else {
                return StateExpectations(source: "speculative_decoding.drafter (absent)")
            }
            return StateExpectations(
                kvHeads: drafter.numKeyValueHeads, headDim: drafter.headDim, slidingWindow: drafter.slidingWindow,
                layers: [.slidingKV: drafter.numHiddenLayers, .globalKV: drafter.numHiddenLayers],
                source: "speculative_decoding.drafter", layersSource: "speculative_decoding.drafter.num_hidden_layers")
        }
    }

    func states(_ role: AssetRole) -> PropertyResult {
        evaluate("\(role).states") {
            let package = try package(role)
            let entries = metadata.assets[role]?.states ?? []
            let expectations = stateExpectations(for: role)
            var problems = Problems()
            if expectations.kvHeads == nil, role != .target,
               metadata.speculativeDecoding == nil, !entries.isEmpty {
                problems.add("metadata.json has no speculative_decoding.drafter to check the states against")
            }

            for entry in entries {
                checkEntry(entry, against: expectations, problems: &problems)
            }

            let expectedNames = entries.map(\.name.rawValue).sorted()
            for function in package.functions {
                let names = function.states.map(\.name).sorted()
                problems.require(names == expectedNames,
                                 "function \(function.name) binds states \(names) but metadata lists \(expectedNames)")
                for state in function.states {
                    guard let entry = entries.first(where: { $0.name.rawValue == state.name }) else { continue }
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
            problems.require(entry.layers == layers, "\(label) layers \(entry.layers) != \(expected.layersSource) \(layers)")
        }
        switch entry.kind {
        case .slidingKV:
            if let window = expected.slidingWindow {
                problems.require(entry.capacity >= window,
                                 "\(label) capacity \(entry.capacity) < \(expected.source).sliding_window \(window)")
            }
        case .globalKV:
            problems.require(entry.capacity == metadata.contextLength,
                             "\(label) capacity \(entry.capacity) != context_length \(metadata.contextLength)")
        }
    }

    func functionMap(_ role: AssetRole) -> PropertyResult {
        evaluate("\(role).function_map") {
            let package = try package(role)
            guard let asset = metadata.assets[role] else { return "no asset" }
            var problems = Problems()
            problems.require(package.defaultFunctionName == asset.defaultFunction.rawValue,
                             "default function is \"\(package.defaultFunctionName)\" but metadata says \"\(asset.defaultFunction)\"")
            for (name, expected) in asset.functions.sorted(by: { $0.key.rawValue < $1.key.rawValue }) {
                guard let function = package.function(named: name.rawValue) else {
                    problems.add("metadata lists function \(name) but the package has \(package.functionNames)")
                    continue
                }
                let inputs = function.inputs.map(\.name)
                let outputs = function.outputs.map(\.name)
                problems.require(inputs.sorted() == expected.inputs.map(\.rawValue).sorted(),
                                 "\(name) inputs are \(inputs) but metadata says \(expected.inputs)")
                problems.require(outputs.sorted() == expected.outputs.map(\.rawValue).sorted(),
                                 "\(name) outputs are \(outputs) but metadata says \(expected.outputs)")
            }
            return try problems.verdict(asset.functions.keys.map(\.rawValue).sorted().joined(separator: ", "))
        }
    }
}
