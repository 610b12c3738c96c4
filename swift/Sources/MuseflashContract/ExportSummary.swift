import ExportMetadata
import MLPackage

extension ContractReport {
    /// A human-readable account of what was found, printed before the verdict
    /// so a failing property can be read against the actual interface.
    public var summaryLines: [String] {
        var lines = ["Export directory: \(exportDirectory.path)"]
        guard let metadata = metadata else {
            lines.append("metadata.json: schema not understood; interface not read")
            return lines
        }
        lines.append("Model: \(metadata.modelName) (schema \(metadata.schemaVersion), "
                     + "\(metadata.generator.name) \(metadata.generator.version))")
        lines.append("  vocab_size \(metadata.vocabSize), context_length \(metadata.contextLength), "
                     + "compute_precision \(metadata.computePrecision)")
        let target = metadata.target
        let sliding = target.layerTypes.filter { $0 == .slidingAttention }.count
        lines.append("  target: \(target.numHiddenLayers) layers (\(sliding) sliding, "
                     + "\(target.layerTypes.count - sliding) full), hidden \(target.hiddenSize), "
                     + "heads \(target.numAttentionHeads)/\(target.numKeyValueHeads) kv, head_dim \(target.headDim), "
                     + "sliding_window \(target.slidingWindow)")
        if let speculative = metadata.speculativeDecoding {
            lines.append("  speculative decoding: \(speculative.drafterKind), block_size \(speculative.blockSize), "
                         + "num_draft_tokens \(speculative.numDraftTokens), drafter_hidden_size \(speculative.drafterHiddenSize), "
                         + "target_layer_ids \(speculative.targetLayerIds), mask_token_id \(speculative.maskTokenId)")
            let drafter = speculative.drafter
            lines.append("  drafter: \(drafter.numHiddenLayers) layers, heads \(drafter.numAttentionHeads)/"
                         + "\(drafter.numKeyValueHeads) kv, head_dim \(drafter.headDim), sliding_window \(drafter.slidingWindow)")
            if let dflash2 = speculative.dflash2 {
                lines.append("  dflash2: \(dflash2.summary)")
            }
        } else {
            lines.append("  speculative decoding: none")
        }
        if let tokenizer = metadata.tokenizer {
            let special = tokenizer.specialTokens.sorted { ($0.value, $0.key) < ($1.value, $1.key) }
                .map { "\"\($0.key)\"=\($0.value)" }
            lines.append("  tokenizer: \(tokenizer.files.joined(separator: ", ")); vocab_size \(tokenizer.vocabSize), "
                         + "special tokens \(special.isEmpty ? "none" : special.joined(separator: ", "))")
        } else {
            lines.append("  tokenizer: none")
        }
        if let compression = metadata.compression {
            lines.append("  compression: \(compression.preset.map { "preset \($0)" } ?? "rules from --compression-config"), "
                         + "\(compression.groups.count) groups of \(compression.groups.map(\.tensors).reduce(0, +)) weights, "
                         + "\(compression.fp16Tensors) fp16 (\(compression.fp16Bytes) bytes)")
            for (index, group) in compression.groups.enumerated() {
                let rule = compression.rules.indices.contains(group.rule) ? " \"\(compression.rules[group.rule].match)\"" : ""
                let packages = group.packages.sorted { $0.key.rawValue < $1.key.rawValue }
                    .map { "\($0.key) \($0.value.tensors)" }.joined(separator: ", ")
                lines.append("    group \(index) (rule \(group.rule)\(rule)): \(LoadedBundle.schemeText(group)), "
                             + "\(group.tensors) weights, \(group.bytesBefore) -> \(group.bytesAfter) bytes; \(packages)")
            }
        } else {
            lines.append("  compression: none")
        }
        for role in metadata.orderedRoles {
            guard let asset = metadata.assets[role] else { continue }
            let file = metadata.package(of: role)
            let owner = file?.owner ?? role
            lines.append("")
            lines.append("Asset \(role) (\(asset.kind)): \(asset.path)"
                         + (owner == role ? "" : " (shared with \(owner), which owns it)"))
            if let buckets = asset.buckets {
                let contexts = buckets.map { String($0.context) }.joined(separator: ", ")
                lines.append("  context buckets: \(buckets.isEmpty ? "none" : contexts)")
            }
            guard let package = packages[role] else {
                lines.append("  not read (missing)")
                continue
            }
            if owner == role {
                lines.append("  default function: \(package.defaultFunctionName)")
            }
            // A shared package's functions, each under the asset it belongs to (bucket functions
            // under the asset whose function table lists them); those no asset lists under the owner.
            var functions = metadata.functions(of: role, in: package).map { ($0, "") }
            if let file = file, file.isShared, owner == role {
                functions += metadata.unlistedFunctions(of: file, in: package).map { ($0, " (listed by no asset)") }
            }
            for (function, note) in functions {
                lines.append("  function \(function.name)\(note)")
                lines += function.inputs.map { "    in    \($0.name): \(describe($0.type))" }
                lines += function.outputs.map { "    out   \($0.name): \(describe($0.type))" }
                lines += function.states.map { "    state \($0.name): \(describe($0.type))" }
            }
        }
        return lines
    }
}

extension ExportMetadata.DFlash2Settings {
    /// Every setting, as `key value`.
    var summary: String {
        "conv_kernel_size \(convKernelSize), conv_group_size \(convGroupSize), selector_rank \(selectorRank), "
            + "selector_top_k \(selectorTopK), selector_decoding \(selectorDecoding), output_multiplier \(outputMultiplier), "
            + "final_logit_softcapping \(finalLogitSoftcapping.map { String($0) } ?? "none")"
    }
}
