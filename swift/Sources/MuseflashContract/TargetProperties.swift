import ExportMetadata
import MLPackage

extension LoadedBundle {
    private var targetRole: AssetRole { .target }

    func targetProperties() -> [PropertyResult] {
        var results = [targetInputs(), targetOutputs(), targetTree()]
        if let drafterRole = drafterRole {
            results.append(drafterVocabularyAgrees(drafterRole))
        }
        return results
    }

    /// The role whose logits must match the target's vocabulary, if any.
    var drafterRole: AssetRole? {
        [AssetRole.dflashDrafter, .ringDrafter].first { metadata.assets[$0] != nil }
    }

    func targetInputs() -> PropertyResult {
        evaluate("\(targetRole).inputs") {
            // Each bucket's main (`main_64`) like the whole-capacity one.
            let mains = try functionAndBuckets(.main, of: targetRole)
            let table = metadata.assets[targetRole]?.functionTable ?? []
            var problems = Problems()
            let required = [InputName.inputIDs, .positionIDs]
            var verifies = ""
            for main in mains {
                for name in required {
                    problems.require(main.input(name) != nil,
                                     "\(main.name) has no input \(name) (inputs: \(main.inputs.map(\.name)))")
                }
                // One main call verifies one drafted block: its query length is the block
                // (--num-draft-tokens + 1), in the package and in metadata.json.
                guard metadata.assets[.dflashDrafter] != nil, let settings = metadata.speculativeDecoding else { continue }
                let block = Int64(settings.blockSize)
                if let ids = main.input(.inputIDs) {
                    let admits = ids.type.multiArray.map { $0.admits(size: block, atAxis: -1) } ?? false
                    problems.require(admits, "\(main.name) \(InputName.inputIDs) is \(describe(ids.type)); "
                                     + "one call verifies one block, so it must admit block_size = \(block) tokens")
                }
                let declared = table.first { $0.name == main.name }?.spec.queryLength
                problems.require(declared == settings.blockSize,
                                 "metadata.json gives \(main.name) query_length \(declared.map(String.init) ?? "none") "
                                 + "but speculative_decoding.block_size \(settings.blockSize); re-export")
                verifies = ", verif\(mains.count == 1 ? "ies" : "y") blocks of \(block)"
            }
            // The one-token decode (and each bucket's) takes the same inputs, one token a call.
            let decodes = try targetDecodes()
            for decode in decodes {
                for name in required {
                    problems.require(decode.input(name) != nil,
                                     "\(decode.name) has no input \(name) (inputs: \(decode.inputs.map(\.name)))")
                }
                if let ids = decode.input(.inputIDs) {
                    let admits = ids.type.multiArray.map { $0.admits(size: 1, atAxis: -1) } ?? false
                    problems.require(admits, "\(decode.name) \(InputName.inputIDs) is \(describe(ids.type)); "
                                     + "a decode call takes one token")
                }
            }
            let decoding = decodes.isEmpty ? "" : "; \(decodes.map(\.name).joined(separator: ", ")) one token a call"
            return try problems.verdict(mains.map(\.name).joined(separator: ", ")
                                        + " take\(mains.count == 1 ? "s" : "") "
                                        + required.map(\.rawValue).joined(separator: " and ") + verifies + decoding)
        }
    }

    func targetOutputs() -> PropertyResult {
        evaluate("\(targetRole).outputs") {
            let asset = metadata.assets[targetRole]
            let mains = try functionAndBuckets(.main, of: targetRole) + targetDecodes() + targetTrees()
            var problems = Problems()
            var expected = [(OutputName.logits, "vocab_size", Int64(metadata.vocabSize))]
            switch asset?.kind {
            case .fusedTarget?:
                if let settings = metadata.speculativeDecoding {
                    expected.append((.drafterFeatures, "speculative_decoding.drafter_hidden_size",
                                     Int64(settings.drafterHiddenSize)))
                } else {
                    problems.add("kind is \(AssetKind.fusedTarget) but metadata.json has no "
                                 + "speculative_decoding.drafter_hidden_size")
                }
            case .target?:
                break
            case let kind:
                problems.add("asset kind \(kind.map(\.rawValue) ?? "?") is neither \(AssetKind.fusedTarget) "
                             + "nor \(AssetKind.target)")
            }
            for main in mains {
                for (name, key, size) in expected {
                    problems.require(main.output(name) != nil,
                                     "\(main.name) has no output \(name) (outputs: \(main.outputs.map(\.name)))")
                    if let output = main.output(name) {
                        problems.require(lastDimension(of: output) == size,
                                         "\(main.name) output \(name) is \(describe(output.type)); "
                                         + "last dim must be \(key) = \(size)")
                    }
                }
            }
            return try problems.verdict(expected.map { "\($0.0)[..., \($0.2)]" }.joined(separator: ", "))
        }
    }

    /// The target's one-token `decode` and each bucket's, when metadata.json lists one.
    private func targetDecodes() throws -> [FunctionDescription] {
        metadata.assets[targetRole]?.decode == nil ? [] : try functionAndBuckets(.decode, of: targetRole)
    }

    /// The target's `tree` and each bucket's, when metadata.json lists one.
    private func targetTrees() throws -> [FunctionDescription] {
        metadata.assets[targetRole]?.tree == nil ? [] : try functionAndBuckets(.tree, of: targetRole)
    }

    /// The tree verify (docs/trees.md): every `tree` function takes N token ids, N positions
    /// and an int32 [N, N] `tree_mask`, N the query length metadata.json gives it; its outputs
    /// are main's (target.outputs holds their widths).
    func targetTree() -> PropertyResult {
        evaluate("\(targetRole).tree") {
            _ = try function(.main, of: targetRole)  // a missing package fails this too
            guard let spec = metadata.assets[targetRole]?.tree else {
                return "none (a bundle without trees verifies chains through main)"
            }
            let nodes = Int64(spec.queryLength)
            var problems = Problems()
            let trees = try targetTrees()
            for tree in trees {
                let expected: [(InputName, [Int64], ArrayDataType)] = [(.inputIDs, [1, nodes], .int32),
                                                                   (.positionIDs, [nodes], .int32),
                                                                   (.treeMask, [nodes, nodes], .int32)]
                problems.require(tree.inputs.map(\.name) == expected.map(\.0.rawValue),
                                 "\(tree.name) takes \(tree.inputs.map(\.name)); expected \(expected.map(\.0.rawValue))")
                for (name, shape, dataType) in expected {
                    guard let input = tree.input(name), case .multiArray(let array) = input.type else { continue }
                    problems.require(array.shape == shape && array.dataType == dataType,
                                     "\(tree.name) input \(name) is \(describe(array)); expected \(dataType.shortName) \(describe(shape))")
                }
            }
            return try problems.verdict("\(trees.map(\.name).joined(separator: ", ")) take\(trees.count == 1 ? "s" : "") "
                                        + "\(nodes) nodes and an int32 [\(nodes), \(nodes)] \(InputName.treeMask)")
        }
    }

    func drafterVocabularyAgrees(_ drafterRole: AssetRole) -> PropertyResult {
        evaluate("\(targetRole).drafter_vocab_agree") {
            let drafterFunction: FunctionName = drafterRole == .dflashDrafter ? .draft : .main
            let targetLogits = try logitsWidth(of: try function(.main, of: targetRole), label: "\(targetRole) \(FunctionName.main)")
            let drafterLogits = try logitsWidth(of: try function(drafterFunction, of: drafterRole),
                                                label: "\(drafterRole) \(drafterFunction)")
            guard targetLogits == drafterLogits else {
                throw Violation(detail: "\(targetRole) \(OutputName.logits) are \(targetLogits) wide but "
                                + "\(drafterRole) \(drafterFunction) \(OutputName.logits) are \(drafterLogits) wide")
            }
            return "both \(targetLogits) wide"
        }
    }

    private func logitsWidth(of function: FunctionDescription, label: String) throws -> Int64 {
        guard let logits = function.output(.logits) else {
            throw Violation(detail: "\(label) has no output \(OutputName.logits)")
        }
        guard let width = lastDimension(of: logits) else {
            throw Violation(detail: "\(label) \(OutputName.logits) (\(describe(logits.type))) declare no fixed last dimension")
        }
        return width
    }
}

/// The last dimension of a multi-array feature, if the spec fixes it.
func lastDimension(of feature: FeatureDescription) -> Int64? {
    guard case .multiArray(let array) = feature.type else { return nil }
    return array.fixedDimension(atAxis: -1)
}
