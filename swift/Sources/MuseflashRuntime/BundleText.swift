import ExportMetadata
import Foundation
import MuseflashTokenizer

extension MuseflashBundle {
    /// The bundle's tokenizer (tokenizer.json with its config files), checked against
    /// metadata.json: a bundle without one, or one whose vocabulary differs from the metadata's,
    /// is refused with a line naming both files.
    public func tokenizer() throws -> Tokenizer {
        guard let listed = metadata.tokenizer else {
            throw RuntimeError.badOption(reason: "\(url.path) has no tokenizer (metadata.json tokenizer is null); export a checkpoint whose folder holds tokenizer.json, or give --prompt-ids")
        }
        let tokenizer = try Tokenizer(directory: url)
        let metadataPath = url.appendingPathComponent(BundleContract.metadataFileName).path
        let tokenizerPath = url.appendingPathComponent(BundleContract.tokenizerFileName).path
        // Embedding rows past the tokenizer are padding (vocab_size may exceed its ids).
        if listed.vocabSize != tokenizer.vocabularySize || metadata.vocabSize < tokenizer.vocabularySize {
            let (key, size) = listed.vocabSize != tokenizer.vocabularySize
                ? ("tokenizer.vocab_size", listed.vocabSize) : ("vocab_size", metadata.vocabSize)
            throw RuntimeError.badOption(reason: "\(tokenizerPath) has \(tokenizer.vocabularySize) token ids but \(metadataPath) \(key) is \(size); the tokenizer does not belong to this export, re-export it")
        }
        return tokenizer
    }
}

/// Text in and out with a bundle's tokenizer, by the conventions Python's `//:generate` uses
/// (runtime/generate.py TextTokenizer): a BOS token goes in front when the tokenizer config
/// names one and does not switch `add_bos_token` off; decoding leaves special tokens out and
/// stops at the end-of-sequence token.
public struct BundleText: Sendable {
    public let tokenizer: Tokenizer
    public let eosTokenID: Int32?

    public init(bundle: MuseflashBundle) throws {
        tokenizer = try bundle.tokenizer()
        eosTokenID = bundle.eosTokenID ?? tokenizer.eosTokenID
    }

    public func encode(_ text: String) throws -> [Int32] {
        let ids = tokenizer.encode(text)
        guard !ids.isEmpty else {
            throw RuntimeError.badOption(reason: "the prompt has no tokens after tokenization; give some text")
        }
        if let bos = tokenizer.bosTokenID, tokenizer.addBOSToken != false { return [bos] + ids }
        return ids
    }

    /// The text of generated ids, up to the end-of-sequence token.
    public func decode(_ ids: [Int32]) -> String {
        tokenizer.decode(Array(ids.prefix { $0 != eosTokenID }), skipSpecialTokens: true)
    }

    /// Streams the text of ids as they arrive, holding back split UTF-8 characters and
    /// ignoring everything from the end-of-sequence token on.
    public struct Stream {
        var decoder: StreamingDecoder
        let eos: Int32?
        public private(set) var ended = false

        public mutating func push(_ ids: [Int32]) -> String {
            guard !ended else { return "" }
            var text = ""
            for id in ids {
                if id == eos { ended = true; break }
                text += decoder.push(id)
            }
            return text
        }

        public mutating func finish() -> String { decoder.finish() }
    }

    public func stream() -> Stream {
        Stream(decoder: tokenizer.streamingDecoder(skipSpecialTokens: true), eos: eosTokenID)
    }
}
