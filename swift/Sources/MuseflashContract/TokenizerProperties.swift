import Foundation
import ExportMetadata

/// The tokenizer files copied into the export. Like a drafter, the tokenizer is an optional
/// part of a bundle: these properties are evaluated only when metadata.json has a `tokenizer`
/// (and `tokenizer.mask_token` only when it also has `speculative_decoding`).
///
/// tokenizer.json is read once. When it is absent or unreadable, `tokenizer.files` says why and
/// the properties that need its content fail saying they were not checked.
extension LoadedBundle {
    typealias TokenizerSettings = ExportMetadata.Tokenizer

    private var tokenizerFileName: String { BundleContract.tokenizerFileName }

    func tokenizerProperties(_ settings: TokenizerSettings) -> [PropertyResult] {
        let file = loadTokenizerFile(settings)
        var results = [tokenizerFiles(settings, file), tokenizerVocabSize(settings, file)]
        if let speculative = metadata.speculativeDecoding {
            results.append(tokenizerMaskToken(settings, speculative, file))
        }
        return results
    }

    private func loadTokenizerFile(_ settings: TokenizerSettings) -> Result<TokenizerFile, Error> {
        let name = tokenizerFileName
        guard settings.files.contains(name), let url = exportURL(name) else {
            return .failure(TokenizerFile.Unusable(description: "tokenizer.files lists no \(name)"))
        }
        return Result { try TokenizerFile.load(from: url, name: name) }
    }

    /// Every listed file is a file inside the export directory, tokenizer.json comes first, and
    /// tokenizer.json is a Hugging Face tokenizer.
    func tokenizerFiles(_ settings: TokenizerSettings, _ file: Result<TokenizerFile, Error>) -> PropertyResult {
        evaluate("tokenizer.files") {
            let name = tokenizerFileName
            var problems = Problems()
            if let first = settings.files.first {
                problems.require(first == name, "the first file is \"\(first)\", not \(name)")
            } else {
                problems.add("tokenizer.files is empty; \(name) must come first")
            }
            var seen = Set<String>()
            var present = Set<String>()
            for path in settings.files {
                guard seen.insert(path).inserted else {
                    problems.add("\(path) is listed twice")
                    continue
                }
                guard let url = exportURL(path) else {
                    problems.add("path \"\(path)\" is not a relative path inside the export directory")
                    continue
                }
                var isDirectory: ObjCBool = false
                if !FileManager.default.fileExists(atPath: url.path, isDirectory: &isDirectory) {
                    problems.add("\(path) does not exist")
                } else if isDirectory.boolValue {
                    problems.add("\(path) is a directory, not a file")
                } else {
                    present.insert(path)
                }
            }
            // Absence is reported above; here only what is wrong with a file that is there.
            if present.contains(name), case .failure(let error) = file {
                problems.add(String(describing: error))
            }
            let summary = settings.files.map { path -> String in
                guard path == name, case .success(let tokenizer) = file else { return path }
                return "\(path) (\(tokenizer.summary))"
            }
            return try problems.verdict(summary.joined(separator: ", "))
        }
    }

    /// tokenizer.json's ids (model.vocab and added_tokens) are exactly 0..<n, n equals
    /// tokenizer.vocab_size and is at most vocab_size (embedding rows past the tokenizer are
    /// padding no text encodes to: Qwen3 has more rows than tokens).
    func tokenizerVocabSize(_ settings: TokenizerSettings, _ file: Result<TokenizerFile, Error>) -> PropertyResult {
        evaluate("tokenizer.vocab_size") {
            let name = tokenizerFileName
            let vocab = metadata.vocabSize
            var problems = Problems()
            problems.require(settings.vocabSize <= vocab,
                             "tokenizer.vocab_size \(settings.vocabSize) exceeds vocab_size \(vocab)")
            switch file {
            case .failure(let error):
                problems.add("not checked against \(name): \(error) (see tokenizer.files)")
            case .success(let tokenizer):
                switch tokenizer.idRange {
                case .notContiguous(let reason):
                    problems.add("\(name): \(reason)")
                case .contiguous(let count):
                    problems.require(count <= vocab, "\(name) has \(count) ids but vocab_size is \(vocab)")
                    problems.require(count == settings.vocabSize,
                                     "\(name) has \(count) ids but tokenizer.vocab_size is \(settings.vocabSize)")
                }
            }
            return try problems.verdict("\(name) has ids 0..\(settings.vocabSize - 1) = tokenizer.vocab_size, "
                                        + "vocab_size \(vocab)")
        }
    }

    /// speculative_decoding.mask_token_id is a special added token of tokenizer.json and is
    /// listed under the same text in tokenizer.special_tokens.
    func tokenizerMaskToken(_ settings: TokenizerSettings, _ speculative: ExportMetadata.SpeculativeDecoding,
                            _ file: Result<TokenizerFile, Error>) -> PropertyResult {
        evaluate("tokenizer.mask_token") {
            let name = tokenizerFileName
            let mask = speculative.maskTokenId
            var problems = Problems()
            let listed = settings.specialTokens.filter { $0.value == mask }.map(\.key).sorted()
            problems.require(!listed.isEmpty,
                             "mask_token_id \(mask) is not in tokenizer.special_tokens "
                             + "(\(describeSpecial(settings.specialTokens.map { ($0.key, $0.value) })))")
            var text = listed.first
            switch file {
            case .failure(let error):
                problems.add("not checked against \(name): \(error) (see tokenizer.files)")
            case .success(let tokenizer):
                let added = tokenizer.addedTokens.filter { $0.id == mask }
                let special = added.filter(\.special)
                if let token = special.first {
                    text = token.content
                    problems.require(listed.isEmpty || special.contains { listed.contains($0.content) },
                                     "tokenizer.special_tokens calls id \(mask) \(listed.map { "\"\($0)\"" }.joined(separator: ", ")) "
                                     + "but \(name) calls it \"\(token.content)\"")
                } else if let token = added.first {
                    problems.add("mask_token_id \(mask) is \(name)'s added token \"\(token.content)\", "
                                 + "which is not special")
                } else {
                    problems.add("mask_token_id \(mask) is not an added token of \(name) (special tokens: "
                                 + "\(describeSpecial(tokenizer.specialTokens.map { ($0.content, $0.id) })))")
                }
            }
            return try problems.verdict("mask_token_id \(mask) is the special token \"\(text ?? "?")\"")
        }
    }

    /// `"<mask>"=511, "<pad>"=0` in id order, at most eight.
    private func describeSpecial(_ tokens: [(String, Int)]) -> String {
        guard !tokens.isEmpty else { return "none" }
        let sorted = tokens.sorted { ($0.1, $0.0) < ($1.1, $1.0) }
        let shown = sorted.prefix(8).map { "\"\($0.0)\"=\($0.1)" }.joined(separator: ", ")
        return sorted.count > 8 ? "\(shown) and \(sorted.count - 8) more" : shown
    }
}
