import ExportMetadata
import MLPackage

enum FeatureName {
    static let inputIDs = "input_ids"
    static let positionIDs = "position_ids"
    static let logits = "logits"
    static let drafterFeatures = "drafter_features"
    static let features = "features"
}

enum FunctionName {
    static let main = "main"
    static let injectKV = "inject_kv"
    static let draft = "draft"
}

extension LoadedBundle {
    private var targetRole: String { ExportMetadata.AssetRole.target }

    func targetProperties() -> [PropertyResult] {
        var results = [targetInputs(), targetOutputs()]
        if let drafterRole = drafterRole {
            results.append(drafterVocabularyAgrees(drafterRole))
        }
        return results
    }

    /// The role whose logits must match the target's vocabulary, if any.
    var drafterRole: String? {
        [ExportMetadata.AssetRole.dflashDrafter, ExportMetadata.AssetRole.ringDrafter]
            .first { metadata.assets[$0] != nil }
    }

    func targetInputs() -> PropertyResult {
        evaluate("target.inputs") {
            let main = try function(FunctionName.main, of: targetRole)
            var problems = Problems()
            for name in [FeatureName.inputIDs, FeatureName.positionIDs] {
                problems.require(main.input(named: name) != nil,
                                 "main has no input \(name) (inputs: \(main.inputs.map(\.name)))")
            }
            return try problems.verdict("main takes input_ids and position_ids")
        }
    }

    func targetOutputs() -> PropertyResult {
        evaluate("target.outputs") {
            let asset = metadata.assets[targetRole]
            let main = try function(FunctionName.main, of: targetRole)
            var problems = Problems()
            var expected = [(FeatureName.logits, "vocab_size", Int64(metadata.vocabSize))]
            switch asset?.kind {
            case ExportMetadata.AssetKind.fusedTarget:
                if let settings = metadata.speculativeDecoding {
                    expected.append((FeatureName.drafterFeatures, "speculative_decoding.drafter_hidden_size",
                                     Int64(settings.drafterHiddenSize)))
                } else {
                    problems.add("kind is fused_target but metadata.json has no speculative_decoding.drafter_hidden_size")
                }
            case ExportMetadata.AssetKind.target:
                break
            default:
                problems.add("asset kind \(asset?.kind ?? "?") is neither fused_target nor target")
            }
            for (name, key, size) in expected {
                problems.require(main.output(named: name) != nil,
                                 "main has no output \(name) (outputs: \(main.outputs.map(\.name)))")
                if let output = main.output(named: name) {
                    problems.require(lastDimension(of: output) == size,
                                     "main output \(name) is \(describe(output.type)); last dim must be \(key) = \(size)")
                }
            }
            return try problems.verdict(expected.map { "\($0.0)[..., \($0.2)]" }.joined(separator: ", "))
        }
    }

    func drafterVocabularyAgrees(_ drafterRole: String) -> PropertyResult {
        evaluate("target.drafter_vocab_agree") {
            let drafterFunction = drafterRole == ExportMetadata.AssetRole.dflashDrafter ? FunctionName.draft : FunctionName.main
            let targetLogits = try logitsWidth(of: try function(FunctionName.main, of: targetRole), label: "target main")
            let drafterLogits = try logitsWidth(of: try function(drafterFunction, of: drafterRole),
                                                label: "\(drafterRole) \(drafterFunction)")
            guard targetLogits == drafterLogits else {
                throw Violation(detail: "target logits are \(targetLogits) wide but \(drafterRole) \(drafterFunction) "
                                + "logits are \(drafterLogits) wide")
            }
            return "both \(targetLogits) wide"
        }
    }

    private func logitsWidth(of function: FunctionDescription, label: String) throws -> Int64 {
        guard let logits = function.output(named: FeatureName.logits) else {
            throw Violation(detail: "\(label) has no output logits")
        }
        guard let width = lastDimension(of: logits) else {
            throw Violation(detail: "\(label) logits (\(describe(logits.type))) declare no fixed last dimension")
        }
        return width
    }
}

/// The last dimension of a multi-array feature, if the spec fixes it.
func lastDimension(of feature: FeatureDescription) -> Int64? {
    guard case .multiArray(let array) = feature.type else { return nil }
    return array.fixedDimension(atAxis: -1)
}
