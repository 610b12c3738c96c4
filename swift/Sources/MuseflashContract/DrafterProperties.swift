import ExportMetadata
import MLPackage

extension LoadedBundle {
    private var dflashRole: String { ExportMetadata.AssetRole.dflashDrafter }
    private var ringRole: String { ExportMetadata.AssetRole.ringDrafter }

    func dflashDrafterProperties() -> [PropertyResult] {
        [drafterFunctions(), drafterSharedStates(), injectKVSignature(), draftSignature()]
    }

    func ringDrafterProperties() -> [PropertyResult] {
        [ringDrafterMainSignature()]
    }

    func drafterFunctions() -> PropertyResult {
        evaluate("drafter.functions") {
            let names = try package(dflashRole).functionNames
            let expected = [FunctionName.injectKV, FunctionName.draft]
            guard names.sorted() == expected.sorted() else {
                throw Violation(detail: "functions are \(names); exactly \(expected) are required")
            }
            return "inject_kv, draft"
        }
    }

    /// The app creates one state and passes it to both functions, so they
    /// must agree on every state exactly.
    func drafterSharedStates() -> PropertyResult {
        evaluate("drafter.shared_states") {
            let injectKV = try function(FunctionName.injectKV, of: dflashRole)
            let draft = try function(FunctionName.draft, of: dflashRole)
            var problems = Problems()
            let injectNames = injectKV.states.map(\.name).sorted()
            let draftNames = draft.states.map(\.name).sorted()
            problems.require(!injectNames.isEmpty, "inject_kv binds no states")
            problems.require(injectNames == draftNames, "inject_kv binds \(injectNames) but draft binds \(draftNames)")
            for state in injectKV.states {
                guard let other = draft.state(named: state.name) else { continue }
                problems.require(state.type.multiArray?.shape == other.type.multiArray?.shape,
                                 "\(state.name) is \(describe(state.type)) in inject_kv but \(describe(other.type)) in draft")
                for (function, feature) in [("inject_kv", state), ("draft", other)] {
                    problems.require(feature.type.multiArray?.dataType == .float16,
                                     "\(state.name) in \(function) is \(describe(feature.type)), not fp16")
                }
            }
            for (function, reason) in (try package(dflashRole)).stateCreationFailures.sorted(by: { $0.key < $1.key }) {
                problems.add("Core ML could not make the state of \(function): \(reason)")
            }
            return try problems.verdict(injectNames.joined(separator: ", "))
        }
    }

    func injectKVSignature() -> PropertyResult {
        evaluate("drafter.inject_kv_signature") {
            let settings = try speculativeDecoding()
            let injectKV = try function(FunctionName.injectKV, of: dflashRole)
            let width = Int64(settings.drafterHiddenSize)
            var problems = Problems()
            if let features = injectKV.input(named: FeatureName.features) {
                problems.require(lastDimension(of: features) == width,
                                 "features is \(describe(features.type)); last dim must be drafter_hidden_size = \(width)")
            } else {
                problems.add("inject_kv has no input features (inputs: \(injectKV.inputs.map(\.name)))")
            }
            problems.require(injectKV.input(named: FeatureName.positionIDs) != nil,
                             "inject_kv has no input position_ids (inputs: \(injectKV.inputs.map(\.name)))")
            problems.require(!injectKV.outputs.isEmpty, "inject_kv has no outputs; Core ML programs need one")
            return try problems.verdict("features[..., \(width)], position_ids -> \(injectKV.outputs.map(\.name))")
        }
    }

    func draftSignature() -> PropertyResult {
        evaluate("drafter.draft_signature") {
            let settings = try speculativeDecoding()
            let draft = try function(FunctionName.draft, of: dflashRole)
            let blockSize = Int64(settings.blockSize)
            let vocab = Int64(metadata.vocabSize)
            var problems = Problems()
            if let inputIDs = draft.input(named: FeatureName.inputIDs) {
                let admits = inputIDs.type.multiArray.map { $0.admits(size: blockSize, atAxis: -1) } ?? false
                problems.require(admits, "input_ids is \(describe(inputIDs.type)); it must admit block_size = \(blockSize) tokens")
            } else {
                problems.add("draft has no input input_ids (inputs: \(draft.inputs.map(\.name)))")
            }
            problems.require(draft.input(named: FeatureName.positionIDs) != nil,
                             "draft has no input position_ids (inputs: \(draft.inputs.map(\.name)))")
            let expectedShape: [Int64] = [1, blockSize, vocab]
            if let logits = draft.output(named: FeatureName.logits) {
                problems.require(logits.type.multiArray?.shape == expectedShape,
                                 "logits is \(describe(logits.type)); expected [1, block_size, vocab_size] = \(describe(expectedShape))")
            } else {
                problems.add("draft has no output logits (outputs: \(draft.outputs.map(\.name)))")
            }
            return try problems.verdict("input_ids[..., \(blockSize)], position_ids -> logits \(describe(expectedShape))")
        }
    }

    func ringDrafterMainSignature() -> PropertyResult {
        evaluate("ring_drafter.main_signature") {
            let main = try function(FunctionName.main, of: ringRole)
            let vocab = Int64(metadata.vocabSize)
            var problems = Problems()
            for name in [FeatureName.inputIDs, FeatureName.positionIDs] {
                problems.require(main.input(named: name) != nil, "main has no input \(name) (inputs: \(main.inputs.map(\.name)))")
            }
            if let logits = main.output(named: FeatureName.logits) {
                problems.require(lastDimension(of: logits) == vocab,
                                 "logits is \(describe(logits.type)); last dim must be vocab_size = \(vocab)")
            } else {
                problems.add("main has no output logits (outputs: \(main.outputs.map(\.name)))")
            }
            return try problems.verdict("input_ids, position_ids -> logits[..., \(vocab)]")
        }
    }
}
