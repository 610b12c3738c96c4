import Foundation
import ExportMetadata

extension LoadedBundle {
    func schemaVersion() -> PropertyResult {
        evaluate("metadata.schema_version") {
            guard metadata.isSchemaVersionSupported else {
                throw Violation(detail: "schema_version \(metadata.schemaVersion) is not one of "
                                + "\(ExportMetadata.supportedSchemaVersions); update the checker or re-export")
            }
            return "schema_version \(metadata.schemaVersion)"
        }
    }

    /// Whether the export ran its own program before publishing (`self_check`, docs/fp16.md):
    /// reported, never failed, since bundles written before the check have no record. A bundle
    /// exported with --no-self-check, or whose target was too large, says so here, with the
    /// export's reason, so a user knows to run `//:verify`.
    func selfCheckRecord() -> PropertyResult {
        evaluate("metadata.self_check") {
            guard case .object(let top) = metadataJSON, case .object(let record)? = top["self_check"] else {
                return "NOT self-checked: metadata.json has no self_check record (written before the export "
                    + "checked its own program); run //:verify"
            }
            guard case .bool(let checked)? = record["checked"] else {
                throw Violation(detail: "self_check.checked is \(record["checked"].map { "\($0)" } ?? "missing"), not a boolean")
            }
            guard checked else {
                let reason: String
                if case .string(let text)? = record["reason"] { reason = text } else { reason = "no reason recorded" }
                return "NOT self-checked (\(reason)); run //:verify before shipping it"
            }
            var functions: [String] = []
            if case .array(let names)? = record["functions"] {
                functions = names.compactMap { if case .string(let name) = $0 { return name } else { return nil } }
            }
            guard !functions.isEmpty else {
                throw Violation(detail: "self_check.checked is true but self_check.functions names no function")
            }
            return "self-checked: \(functions.joined(separator: ", ")) against fp32 eager before publishing"
        }
    }

    /// Every package an asset names exists (a shared package once, naming all its roles).
    /// Before schema version 3 every asset has a package of its own, so two naming the same
    /// path fail.
    func assetsExist() -> PropertyResult {
        evaluate("metadata.assets_exist") {
            var problems = Problems()
            if metadata.assets.isEmpty { problems.add("metadata.json lists no assets") }
            for file in packageFiles {
                if let reason = missing[file.owner] {
                    problems.add("\(file.roles.map(\.rawValue).joined(separator: ", ")): \(reason)")
                }
            }
            if !metadata.allowsSharedPackages {
                let byPath = Dictionary(grouping: roles) { metadata.assets[$0]!.path }
                for (path, sharing) in byPath.sorted(by: { $0.key < $1.key }) where sharing.count > 1 {
                    problems.add("\(sharing.map(\.rawValue).joined(separator: " and ")) name the same package \(path), "
                                 + "but assets share a package only from schema_version "
                                 + "\(ExportMetadata.sharedPackageSchemaVersion) (this is \(metadata.schemaVersion))")
                }
            }
            return try problems.verdict(roles.map { "\($0)=\(metadata.assets[$0]!.path)" }.joined(separator: ", "))
        }
    }

    /// The package's user-defined metadata holds metadata.json's JSON; once per package, named
    /// by its owner.
    func embeddedMetadata(_ role: AssetRole) -> PropertyResult {
        evaluate("\(role).embedded_metadata") {
            let package = try package(role)
            let key = BundleContract.embeddedMetadataKey
            guard let text = package.userDefinedMetadata[key] else {
                throw Violation(detail: "the package has no user-defined metadata entry \(key)")
            }
            let embedded: JSONValue
            do {
                embedded = try JSONDecoder().decode(JSONValue.self, from: Data(text.utf8))
            } catch {
                throw Violation(detail: "\(key) is not valid JSON (\(error))")
            }
            guard embedded == metadataJSON else {
                let differences = metadataJSON.differences(from: embedded)
                throw Violation(detail: "\(key) differs from metadata.json (first: metadata.json, second: embedded): "
                                + differences.joined(separator: "; "))
            }
            return "\(key) equals metadata.json"
        }
    }

    /// What `speculative_decoding.drafter_kind` requires of the rest of metadata.json:
    /// `speculative_decoding.dflash2` is set exactly for a DFlash2 drafter, and within bounds; a
    /// DFlash kind's `draft` declares exactly its outputs (`draft_tokens` only for DFlash2).
    func drafterKindMetadata(_ speculative: ExportMetadata.SpeculativeDecoding) -> PropertyResult {
        evaluate("metadata.drafter_kind") {
            let kind = speculative.drafterKind
            var problems = Problems()
            switch (kind, speculative.dflash2) {
            case (.dflash2, let settings?):
                checkDFlash2(settings, of: speculative, problems: &problems)
            case (.dflash2, nil):
                problems.add("drafter_kind is \(kind) but speculative_decoding.dflash2 is null or absent")
            case (_, _?):
                problems.add("speculative_decoding.dflash2 is set but drafter_kind is \(kind); "
                             + "only \(DrafterKind.dflash2) has it")
            case (_, nil):
                break
            }
            var summary = "\(kind)" + (speculative.dflash2.map { " (\($0.summary))" } ?? "")
            if let expected = kind.draftOutputs {
                let role = kind.assetRole
                if let declared = metadata.assets[role]?.functions[.draft]?.outputs {
                    problems.require(declared == expected,
                                     "assets.\(role).functions.\(FunctionName.draft).outputs are "
                                     + "\(declared.map(\.rawValue)); drafter_kind \(kind) needs exactly "
                                     + "\(expected.map(\.rawValue))")
                } else {
                    problems.add("drafter_kind is \(kind) but metadata.json lists no \(role) function \(FunctionName.draft)")
                }
                summary += ", \(FunctionName.draft) -> \(expected.map(\.rawValue).joined(separator: ", "))"
            }
            return try problems.verdict(summary)
        }
    }

    private func checkDFlash2(_ settings: ExportMetadata.DFlash2Settings, of speculative: ExportMetadata.SpeculativeDecoding,
                              problems: inout Problems) {
        let label = "speculative_decoding.dflash2"
        let counts = [("conv_kernel_size", settings.convKernelSize), ("conv_group_size", settings.convGroupSize),
                      ("selector_rank", settings.selectorRank), ("selector_top_k", settings.selectorTopK)]
        for (key, value) in counts {
            problems.require(value >= 1, "\(label).\(key) is \(value), not at least 1")
        }
        problems.require(settings.selectorTopK <= metadata.vocabSize,
                         "\(label).selector_top_k \(settings.selectorTopK) exceeds vocab_size \(metadata.vocabSize)")
        if settings.convGroupSize >= 1 {
            problems.require(speculative.drafterHiddenSize % settings.convGroupSize == 0,
                             "\(label).conv_group_size \(settings.convGroupSize) does not divide "
                             + "speculative_decoding.drafter_hidden_size \(speculative.drafterHiddenSize)")
        }
        problems.require(settings.convKernelSize <= speculative.blockSize,
                         "\(label).conv_kernel_size \(settings.convKernelSize) exceeds "
                         + "speculative_decoding.block_size \(speculative.blockSize)")
        problems.require(settings.outputMultiplier.isFinite && settings.outputMultiplier > 0,
                         "\(label).output_multiplier is \(settings.outputMultiplier), not finite and positive")
        if let cap = settings.finalLogitSoftcapping {
            problems.require(cap > 0, "\(label).final_logit_softcapping is \(cap); it must be positive or null")
        }
    }
}
