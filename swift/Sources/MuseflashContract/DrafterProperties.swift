import ExportMetadata
import MLPackage

extension LoadedBundle {
    private var dflashRole: AssetRole { .dflashDrafter }
    private var ringRole: AssetRole { .ringDrafter }

    /// For both DFlash kinds (`dflash` and `dflash2`), whose drafters share the `dflash_drafter` role.
    func dflashDrafterProperties() -> [PropertyResult] {
        [drafterFunctions(), drafterSharedStates(), injectKVSignature(), draftSignature(), draftTokens()]
    }

    func ringDrafterProperties() -> [PropertyResult] {
        [ringDrafterMainSignature()]
    }

    /// The DFlash drafter asset lists exactly `inject_kv` and `draft` (and, with context
    /// buckets, copies of them: `inject_kv_64`, `draft_64`), and its package has them all: a
    /// package of its own before schema version 3, from 3 the one it shares with the fused
    /// target. That the package has no function beyond those its assets list (before 3: exactly
    /// these two) is `package.functions`.
    func drafterFunctions() -> PropertyResult {
        evaluate("drafter.functions") {
            let package = try package(dflashRole)
            let expected = [FunctionName.injectKV, .draft].map(\.rawValue)
            let table = metadata.assets[dflashRole]?.functionTable ?? []
            let listed = Array(Set(table.map(\.function.rawValue)))
            var problems = Problems()
            problems.require(listed.sorted() == expected.sorted(),
                             "metadata lists the \(dflashRole) functions \(listed.sorted()); exactly \(expected) are required")
            let buckets = table.filter { $0.context != nil }.map(\.name)
            let missing = (expected + buckets).filter { package.function(named: $0) == nil }
            problems.require(missing.isEmpty, "\(packageLabel(dflashRole)) lacks \(missing) (it has \(package.functionNames))")
            return try problems.verdict(expected.joined(separator: ", ")
                                        + (buckets.isEmpty ? "" : " (and \(buckets.joined(separator: ", ")))"))
        }
    }

    /// The app creates one state and passes it to both functions, so they
    /// must agree on every state exactly; and the states they bind are exactly the
    /// `dflash_drafter` asset's (in a package shared with the target, never the target's).
    func drafterSharedStates() -> PropertyResult {
        evaluate("drafter.shared_states") {
            let injectKV = try function(.injectKV, of: dflashRole)
            let draft = try function(.draft, of: dflashRole)
            var problems = Problems()
            let injectNames = injectKV.states.map(\.name).sorted()
            let draftNames = draft.states.map(\.name).sorted()
            let assetNames = (metadata.assets[dflashRole]?.states ?? []).map(\.name.rawValue).sorted()
            problems.require(!injectNames.isEmpty, "\(FunctionName.injectKV) binds no states")
            problems.require(injectNames == draftNames,
                             "\(FunctionName.injectKV) binds \(injectNames) but \(FunctionName.draft) binds \(draftNames)")
            for (function, names) in [(FunctionName.injectKV, injectNames), (.draft, draftNames)] where names != assetNames {
                problems.add("\(function) binds \(names) but the \(dflashRole) asset's states are \(assetNames)")
            }
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
            let drafterFunctions = Set([FunctionName.injectKV, .draft].map(\.rawValue) + metadata.functionNames(of: dflashRole))
            for (function, reason) in (try package(dflashRole)).stateCreationFailures.sorted(by: { $0.key < $1.key })
            where drafterFunctions.contains(function) {
                problems.add("Core ML could not make the state of \(function): \(reason)")
            }
            return try problems.verdict(injectNames.joined(separator: ", "))
        }
    }

    /// `inject_kv` (and each context bucket's, `inject_kv_64`, alike).
    func injectKVSignature() -> PropertyResult {
        evaluate("drafter.\(FunctionName.injectKV)_signature") {
            let settings = try speculativeDecoding()
            let functions = try functionAndBuckets(.injectKV, of: dflashRole)
            let width = Int64(settings.drafterHiddenSize)
            var problems = Problems()
            for injectKV in functions {
                let inputs = injectKV.inputs.map(\.name)
                if let features = injectKV.input(.features) {
                    problems.require(lastDimension(of: features) == width,
                                     "\(Self.bucketLabel(injectKV, .injectKV))\(InputName.features) is \(describe(features.type)); "
                                     + "last dim must be drafter_hidden_size = \(width)")
                } else {
                    problems.add("\(injectKV.name) has no input \(InputName.features) (inputs: \(inputs))")
                }
                problems.require(injectKV.input(.positionIDs) != nil,
                                 "\(injectKV.name) has no input \(InputName.positionIDs) (inputs: \(inputs))")
                problems.require(!injectKV.outputs.isEmpty, "\(injectKV.name) has no outputs; Core ML programs need one")
            }
            return try problems.verdict("\(InputName.features)[..., \(width)], \(InputName.positionIDs) -> "
                                        + "\(functions.last!.outputs.map(\.name))")
        }
    }

    /// `draft` (and each context bucket's, `draft_64`, alike).
    func draftSignature() -> PropertyResult {
        evaluate("drafter.\(FunctionName.draft)_signature") {
            let settings = try speculativeDecoding()
            let functions = try functionAndBuckets(.draft, of: dflashRole)
            let blockSize = Int64(settings.blockSize)
            let vocab = Int64(metadata.vocabSize)
            var problems = Problems()
            let expectedShape: [Int64] = [1, blockSize, vocab]
            for draft in functions {
                let label = Self.bucketLabel(draft, .draft)
                if let inputIDs = draft.input(.inputIDs) {
                    let admits = inputIDs.type.multiArray.map { $0.admits(size: blockSize, atAxis: -1) } ?? false
                    problems.require(admits, "\(label)\(InputName.inputIDs) is \(describe(inputIDs.type)); "
                                     + "it must admit block_size = \(blockSize) tokens")
                } else {
                    problems.add("\(draft.name) has no input \(InputName.inputIDs) (inputs: \(draft.inputs.map(\.name)))")
                }
                problems.require(draft.input(.positionIDs) != nil,
                                 "\(draft.name) has no input \(InputName.positionIDs) (inputs: \(draft.inputs.map(\.name)))")
                if let logits = draft.output(.logits) {
                    problems.require(logits.type.multiArray?.shape == expectedShape,
                                     "\(label)\(OutputName.logits) is \(describe(logits.type)); "
                                     + "expected [1, block_size, vocab_size] = \(describe(expectedShape))")
                } else {
                    problems.add("\(draft.name) has no output \(OutputName.logits) (outputs: \(draft.outputs.map(\.name)))")
                }
            }
            return try problems.verdict("\(InputName.inputIDs)[..., \(blockSize)], \(InputName.positionIDs) -> "
                                        + "\(OutputName.logits) \(describe(expectedShape))")
        }
    }

    /// A DFlash2 `draft` (and each context bucket's, `draft_64`) also outputs its candidate
    /// selector's greedy path, int32 `[1, block_size - 1]`; a DFlash `draft` has no such output.
    func draftTokens() -> PropertyResult {
        evaluate("drafter.\(OutputName.draftTokens)") {
            let settings = try speculativeDecoding()
            let functions = try functionAndBuckets(.draft, of: dflashRole)
            let expectedShape: [Int64] = [1, Int64(settings.blockSize) - 1]
            var problems = Problems()
            for draft in functions {
                let label = Self.bucketLabel(draft, .draft)
                let output = draft.output(.draftTokens)
                guard settings.drafterKind == .dflash2 else {
                    if let output = output {
                        problems.add("\(draft.name) has an output \(OutputName.draftTokens) "
                                     + "(\(describe(output.type))), which only drafter_kind \(DrafterKind.dflash2) has")
                    }
                    continue
                }
                guard let output = output else {
                    problems.add("\(draft.name) has no output \(OutputName.draftTokens) "
                                 + "(outputs: \(draft.outputs.map(\.name))), which drafter_kind \(DrafterKind.dflash2) requires")
                    continue
                }
                guard case .multiArray(let array) = output.type else {
                    problems.add("\(label)\(OutputName.draftTokens) is \(describe(output.type)), not a multi-array")
                    continue
                }
                problems.require(array.dataType == .int32, "\(label)\(OutputName.draftTokens) is \(describe(array)), not int32")
                problems.require(array.shape == expectedShape,
                                 "\(label)\(OutputName.draftTokens) is \(describe(array)); "
                                 + "expected [1, block_size - 1] = \(describe(expectedShape))")
            }
            return try problems.verdict(settings.drafterKind == .dflash2
                                        ? "\(OutputName.draftTokens) int32 \(describe(expectedShape))"
                                        : "drafter_kind \(settings.drafterKind): no \(OutputName.draftTokens), as required")
        }
    }

    /// `draft_64 ` before a message about a context bucket's function (whose text names no
    /// function); nothing for the whole-capacity one.
    static func bucketLabel(_ function: FunctionDescription, _ name: FunctionName) -> String {
        function.name == name.rawValue ? "" : "\(function.name) "
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

extension ExportMetadata.DrafterKind {
    /// The outputs the `draft` function declares, in order, for the kinds that have one.
    var draftOutputs: [OutputName]? {
        switch self {
        case .dflash: return [.logits]
        case .dflash2: return [.logits, .draftTokens]
        case .ring: return nil
        }
    }
}
