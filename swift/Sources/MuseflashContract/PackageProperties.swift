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

    /// The asset's state entries fit the model settings and their own names (kind and role),
    /// and every function of the asset (in a shared package: only the asset's own functions,
    /// `ExportMetadata.functions(of:in:)`) binds exactly those states, fp16, of the listed shapes.
    /// Assets sharing a package have states of distinct names; the later asset in pipeline
    /// order fails when a name is taken.
    func states(_ role: AssetRole) -> PropertyResult {
        evaluate("\(role).states") {
            let functions = try functions(of: role)
            let entries = metadata.assets[role]?.states ?? []
            let expectations = stateExpectations(for: role)
            var problems = Problems()
            if expectations.kvHeads == nil, role != .target,
               metadata.speculativeDecoding == nil, !entries.isEmpty {
                problems.add("metadata.json has no speculative_decoding.drafter to check the states against")
            }

            if role == .target {
                // A pair per layer kind the target has, and none for a kind it lacks.
                let expected = ExportMetadata.targetStateNames(layerTypes: metadata.target.layerTypes).map(\.rawValue)
                let listed = entries.map(\.name.rawValue)
                problems.require(listed.sorted() == expected.sorted(),
                                 "metadata lists target states \(listed) but target.layer_types call for \(expected) "
                                 + "(the key/value pair of each layer kind present)")
            }
            for entry in entries {
                checkEntry(entry, against: expectations, problems: &problems)
            }
            if let file = packageFile(of: role), let index = file.roles.firstIndex(of: role) {
                for earlier in file.roles[..<index] {
                    let taken = Set((metadata.assets[earlier]?.states ?? []).map(\.name))
                    for entry in entries where taken.contains(entry.name) {
                        problems.add("state \(entry.name) is also the \(earlier)'s, which shares \(file.path); "
                                     + "assets sharing a package need states of their own")
                    }
                }
            }

            let expectedNames = entries.map(\.name.rawValue).sorted()
            for function in functions {
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
        problems.require(entry.kind == entry.name.kind,
                         "\(label) has kind \(entry.kind), but a state of that name is \(entry.name.kind)")
        problems.require(entry.role == entry.name.role,
                         "\(label) has role \(entry.role), but a state of that name is a \(entry.name.role)")
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

    /// The functions the asset lists (its function table: each context bucket's, `main_64`, and
    /// the whole-capacity ones) are in its package with the listed inputs and outputs; its
    /// `default_function` is one of its whole-capacity functions, and when the asset owns its
    /// package (every asset before schema version 3; of a shared package the first role in
    /// pipeline order) it is the package's default function.
    func functionMap(_ role: AssetRole) -> PropertyResult {
        evaluate("\(role).function_map") {
            let package = try package(role)
            guard let asset = metadata.assets[role] else { return "no asset" }
            var problems = Problems()
            problems.require(asset.functions[asset.defaultFunction] != nil,
                             "default_function \(asset.defaultFunction) is not one of the asset's functions "
                             + "\(asset.functions.keys.map(\.rawValue).sorted())")
            if let file = packageFile(of: role), file.owner == role {
                problems.require(package.defaultFunctionName == asset.defaultFunction.rawValue,
                                 "default function is \"\(package.defaultFunctionName)\" but metadata says \"\(asset.defaultFunction)\""
                                 + (file.isShared ? " (the \(role) owns the package \(file.path), so its default is the package's)" : ""))
            }
            let table = asset.functionTable.sorted { $0.name < $1.name }
            for (name, expected) in table.map({ ($0.name, $0.spec) }) {
                guard let function = package.function(named: name) else {
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
            return try problems.verdict(table.map(\.name).joined(separator: ", "))
        }
    }

    /// `package.functions`: every package has exactly the functions its assets list, the union of
    /// the function tables of the assets whose `path` names it (before schema version 3 one
    /// asset's; from 3 the fused target's `main`, `prefill` (and with context buckets `main_64`,
    /// `prefill_64`, ...) and the DFlash drafter's `inject_kv`, `draft` in their shared package),
    /// and no two of those assets list the same function. One property for all packages; which
    /// package default function is right is `<owner>.function_map`.
    func packageFunctions() -> PropertyResult {
        evaluate("package.functions") {
            var problems = Problems()
            var summary: [String] = []
            for file in packageFiles {
                let label = file.isShared
                    ? "\(file.path) (\(file.roles.map(\.rawValue).joined(separator: ", ")))" : file.path
                let package: PackageInterface
                do {
                    package = try self.package(file.owner)
                } catch let violation as Violation {
                    problems.add("\(label): \(violation.detail)")
                    continue
                }
                var listedBy: [String: AssetRole] = [:]
                for role in file.roles {
                    for name in metadata.functionNames(of: role) {
                        if let other = listedBy[name] {
                            problems.add("\(label): function \(name) is listed by both \(other) and \(role)")
                        } else {
                            listedBy[name] = role
                        }
                    }
                }
                let present = Set(package.functionNames)
                for (name, role) in listedBy.sorted(by: { $0.key < $1.key }) where !present.contains(name) {
                    problems.add("\(label) has no function \(name), which the \(role) lists "
                                 + "(it has \(package.functionNames))")
                }
                let unlisted = package.functionNames.filter { listedBy[$0] == nil }
                if !unlisted.isEmpty {
                    problems.add("\(label) has function\(unlisted.count == 1 ? "" : "s") \(unlisted) that no asset "
                                 + "stored in it lists")
                }
                let duplicates = Dictionary(grouping: package.functionNames, by: { $0 }).filter { $0.value.count > 1 }.keys
                if !duplicates.isEmpty {
                    problems.add("\(label) declares function\(duplicates.count == 1 ? "" : "s") \(duplicates.sorted()) more than once")
                }
                summary.append("\(label): \(package.functionNames.joined(separator: ", "))")
            }
            return try problems.verdict(summary.joined(separator: "; "))
        }
    }
}
