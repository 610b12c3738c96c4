import ExportMetadata
import MLPackage

extension LoadedBundle {
    private var dflashRole: AssetRole { .dflashDrafter }
    private var ringRole: AssetRole { .ringDrafter }

    func dflashDrafterProperties() -> [PropertyResult] {
        [drafterFunctions(), drafterSharedStates(), injectKVSignature(), draftSignature()]
    }

    func ringDrafterProperties() -> [PropertyResult] {
        [ringDrafterMainSignature()]
    }

    func drafterFunctions() -> PropertyResult {
        evaluate("drafter.functions") {
            let names = try package(dflashRole).functionNames
            let expected = [FunctionName.injectKV, .draft].map(\.rawValue)
            guard names.sorted() == expected.sorted() else {
                throw Violation(detail: "functions are \(names); exactly \(expected) are required")
            }
            return expected.joined(separator: ", ")
        }
    }

    /// The app creates one state and passes it to both functions, so they
    /// must agree on every state exactly.
    func drafterSharedStates() -> PropertyResult {
        evaluate("drafter.shared_states") {
            let injectKV = try function(.injectKV, of: dflashRole)
            let draft = try function(.draft, of: dflashRole)
            var problems = Problems()
            let injectNames = injectKV.states.map(\.name).sorted()
            let draftNames = draft.states.map(\.name).sorted()
            problems.require(!injectNames.isEmpty, "\(FunctionName.injectKV) binds no states")
            problems.require(injectNames == draftNames,
                             "\(FunctionName.injectKV) binds \(injectNames) but \(FunctionName.draft) binds \(draftNames)")
            for state in injectKV.states {
                guard let other = draft.state(named: state.name) else { continue }
                problems.require(state.type.multiArray?.shape == other.type.multiArray?.shape,
                                 "\(state.name) is \(describe(state.type)) in \(FunctionName.injectKV) but "
                                 + "\(describe(other.type)) in \(FunctionName.draft)")
                for (function, feature) in [(FunctionName.injectKV, state), (.draft, other)] {
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
        evaluate("drafter.\(FunctionName.injectKV)_signature") {
            let settings = try speculativeDecoding()
            let injectKV = try function(.injectKV, of: dflashRole)
            let width = Int64(settings.drafterHiddenSize)
            var problems = Problems()
            let inputs = injectKV.inputs.map(\.name)
            if let features = injectKV.input(.features) {
                problems.require(lastDimension(of: features) == width,
                                 "\(InputName.features) is \(describe(features.type)); "
                                 + "last dim must be drafter_hidden_size = \(width)")
            } else {
                problems.add("\(FunctionName.injectKV) has no input \(InputName.features) (inputs: \(inputs))")
            }
            problems.require(injectKV.input(.positionIDs) != nil,
                             "\(FunctionName.injectKV) has no input \(InputName.positionIDs) (inputs: \(inputs))")
            problems.require(!injectKV.outputs.isEmpty, "\(FunctionName.injectKV) has no outputs; Core ML programs need one")
            return try problems.verdict("\(InputName.features)[..., \(width)], \(InputName.positionIDs) -> "
                                        + "\(injectKV.outputs.map(\.name))")
        }
    }

    func draftSignature() -> PropertyResult {
        evaluate("drafter.\(FunctionName.draft)_signature") {
            let settings = try speculativeDecoding()
            let draft = try function(.draft, of: dflashRole)
            let blockSize = Int64(settings.blockSize)
            let vocab = Int64(metadata.vocabSize)
            var problems = Problems()
            if let inputIDs = draft.input(.inputIDs) {
                let admits = inputIDs.type.multiArray.map { $0.admits(size: blockSize, atAxis: -1) } ?? false
                problems.require(admits, "\(InputName.inputIDs) is \(describe(inputIDs.type)); "
                                 + "it must admit block_size = \(blockSize) tokens")
            } else {
                problems.add("\(FunctionName.draft) has no input \(InputName.inputIDs) (inputs: \(draft.inputs.map(\.name)))")
            }
            problems.require(draft.input(.positionIDs) != nil,
                             "\(FunctionName.draft) has no input \(InputName.positionIDs) (inputs: \(draft.inputs.map(\.name)))")
            let expectedShape: [Int64] = [1, blockSize, vocab]
            if let logits = draft.output(.logits) {
                problems.require(logits.type.multiArray?.shape == expectedShape,
                                 "\(OutputName.logits) is \(describe(logits.type)); "
                                 + "expected [1, block_size, vocab_size] = \(describe(expectedShape))")
            } else {
                problems.add("\(FunctionName.draft) has no output \(OutputName.logits) (outputs: \(draft.outputs.map(\.name)))")
            }
            return try problems.verdict("\(InputName.inputIDs)[..., \(blockSize)], \(InputName.positionIDs) -> "
                                        + "\(OutputName.logits) \(describe(expectedShape))")
        }
    }

    func ringDrafterMainSignature() -> PropertyResult {
        evaluate("\(ringRole).\(FunctionName.main)_signature") {
            let main = try function(.main, of: ringRole)
            let vocab = Int64(metadata.vocabSize)
            var problems = Problems()
            for name in [InputName.inputIDs, .positionIDs] {
                problems.require(main.input(name) != nil,
                                 "\(FunctionName.main) has no input \(name) (inputs: \(main.inputs.map(\.name)))")
            }
            if let logits = main.output(.logits) {
                problems.require(lastDimension(of: logits) == vocab,
                                 "\(OutputName.logits) is \(describe(logits.type)); last dim must be vocab_size = \(vocab)")
            } else {
                problems.add("\(FunctionName.main) has no output \(OutputName.logits) (outputs: \(main.outputs.map(\.name)))")
            }
            return try problems.verdict("\(InputName.inputIDs), \(InputName.positionIDs) -> "
                                        + "\(OutputName.logits)[..., \(vocab)]")
        }
    }
}
