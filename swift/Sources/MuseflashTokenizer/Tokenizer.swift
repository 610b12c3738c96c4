import Foundation

/// A Hugging Face tokenizer read from `tokenizer.json`, for the kinds museflash's bundles carry:
/// byte-level BPE (GPT-2 style, or Qwen2's and Llama 3's split pattern before ByteLevel, with an
/// optional NFC normalizer) and WordLevel with the Whitespace pre-tokenizer. Anything else
/// that would change the ids is refused when loading (`TokenizerError.unsupported`), never
/// tokenized differently from the `tokenizers` library.
///
/// `encode` equals `Tokenizer.encode(text, add_special_tokens=False).ids` of the tokenizers
/// library: added tokens are split off first (the normalized ones after the normalizer ran on
/// the text between the others), the text between them is pre-tokenized and run
/// through the model; no post-processor template is applied. `decode` equals
/// `Tokenizer.decode(ids, skip_special_tokens=...)`. Thread-safe: encodes run one at a time
/// (they share a cache of pieces).
public final class Tokenizer: @unchecked Sendable {
    public static let fileName = "tokenizer.json"
    public static let configFileName = "tokenizer_config.json"
    public static let specialTokensMapFileName = "special_tokens_map.json"

    public enum Kind: String, Sendable {
        case byteLevelBPE = "byte-level BPE"
        case wordLevel = "WordLevel"
    }

    public let kind: Kind
    /// Distinct ids of the vocabulary and the added tokens (the library's
    /// `get_vocab_size(with_added_tokens=True)`).
    public let vocabularySize: Int
    /// Ids of the added tokens marked `special`.
    public let specialTokenIDs: Set<Int32>
    /// `bos_token`, `eos_token`, `pad_token`, `unk_token`, `mask_token`, ... from
    /// tokenizer_config.json (or special_tokens_map.json) -> id, for the tokens in the vocabulary.
    public let specialTokenRoles: [String: Int32]
    /// tokenizer_config.json's `add_bos_token`, when it says.
    public let addBOSToken: Bool?

    public var bosTokenID: Int32? { specialTokenRoles["bos_token"] }
    public var eosTokenID: Int32? { specialTokenRoles["eos_token"] }
    public var padTokenID: Int32? { specialTokenRoles["pad_token"] }

    enum Model {
        case bpe(BPEModel)
        case wordLevel(WordLevelModel)
    }

    enum Decoder { case byteLevel, none }

    private let model: Model
    let normalizer: Normalizer
    let preTokenizer: PreTokenizer
    let decoder: Decoder
    private let firstPass: AddedTokenMatcher   // added tokens with normalized false, in the text as given
    private let secondPass: AddedTokenMatcher  // normalized true, in the normalized text between those
    private let vocabulary: [String: Int32]
    /// id -> token text; nil for ids no token has.
    let tokenText: [String?]
    /// id -> the bytes the ByteLevel decoder gives it.
    let tokenBytes: [[UInt8]]

    private let lock = NSLock()
    private var cache = PieceCache()

    // MARK: Loading

    /// Reads `tokenizer.json` in `directory`, with `tokenizer_config.json` and
    /// `special_tokens_map.json` beside it when present.
    public convenience init(directory: URL) throws {
        func read(_ name: String, required: Bool) throws -> Data? {
            let url = directory.appendingPathComponent(name)
            var isDirectory: ObjCBool = false
            guard FileManager.default.fileExists(atPath: url.path, isDirectory: &isDirectory), !isDirectory.boolValue else {
                if required { throw TokenizerError.missingFile(path: url.path) }
                return nil
            }
            do {
                return try Data(contentsOf: url)
            } catch {
                throw TokenizerError.unreadable(path: url.path, reason: error.localizedDescription)
            }
        }
        try self.init(tokenizerJSON: try read(Self.fileName, required: true)!,
                      path: directory.appendingPathComponent(Self.fileName).path,
                      tokenizerConfig: try read(Self.configFileName, required: false),
                      configPath: directory.appendingPathComponent(Self.configFileName).path,
                      specialTokensMap: try read(Self.specialTokensMapFileName, required: false),
                      specialTokensMapPath: directory.appendingPathComponent(Self.specialTokensMapFileName).path)
    }

    /// From the files' contents; the paths only label errors.
    public init(tokenizerJSON: Data, path: String = Tokenizer.fileName,
                tokenizerConfig: Data? = nil, configPath: String = Tokenizer.configFileName,
                specialTokensMap: Data? = nil, specialTokensMapPath: String = Tokenizer.specialTokensMapFileName) throws {
        let file = try TokenizerJSON(data: tokenizerJSON, path: path)
        let spec = try file.specification()
        kind = spec.kind
        model = spec.model
        normalizer = spec.normalizer
        preTokenizer = spec.preTokenizer
        decoder = spec.decoder
        vocabulary = spec.vocabulary
        firstPass = AddedTokenMatcher(spec.addedTokens.filter { !$0.normalized })
        secondPass = AddedTokenMatcher(spec.addedTokens.filter(\.normalized))
        specialTokenIDs = Set(spec.addedTokens.filter(\.special).map(\.id))

        var ids = Set(spec.vocabulary.values)
        ids.formUnion(spec.addedTokens.map(\.id))
        vocabularySize = ids.count
        var text = [String?](repeating: nil, count: Int(ids.max().map { $0 + 1 } ?? 0))
        for (token, id) in spec.vocabulary { text[Int(id)] = token }
        for token in spec.addedTokens { text[Int(token.id)] = token.content }
        tokenText = text
        tokenBytes = spec.decoder == .byteLevel ? text.map { $0.map(ByteLevel.bytes(ofToken:)) ?? [] } : []

        var roles: [String: Int32] = [:]
        var addBOS: Bool?
        for (data, label) in [(tokenizerConfig, configPath), (specialTokensMap, specialTokensMapPath)] {
            guard let data else { continue }
            let config = try TokenizerJSON.object(data, path: label)
            for (key, value) in config where key.hasSuffix("_token") && roles[key] == nil {
                let content = (value as? String) ?? ((value as? [String: Any])?["content"] as? String)
                if let content, let id = spec.addedTokens.first(where: { $0.content == content })?.id ?? spec.vocabulary[content] {
                    roles[key] = id
                }
            }
            if label == configPath, let value = config["add_bos_token"] as? Bool { addBOS = value }
        }
        specialTokenRoles = roles
        addBOSToken = addBOS
    }

    // MARK: Vocabulary

    public func token(for id: Int32) -> String? {
        id >= 0 && Int(id) < tokenText.count ? tokenText[Int(id)] : nil
    }

    public func id(for token: String) -> Int32? {
        if let id = vocabulary[token] { return id }
        return tokenText.firstIndex(where: { $0 == token }).map(Int32.init)
    }

    // MARK: Encoding

    public func encode(_ text: String) -> [Int32] {
        let utf8 = Array(text.utf8)
        lock.lock()
        defer { lock.unlock() }
        return utf8.withUnsafeBufferPointer { bytes in
            var ids: [Int32] = []
            ids.reserveCapacity(bytes.count / 3 + 1)
            var first: [Segment] = []
            firstPass.split(bytes, 0..<bytes.count, into: &first)
            var second: [Segment] = []
            var pieces: [Range<Int>] = []
            for segment in first {
                switch segment {
                case .token(let id):
                    ids.append(id)
                case .text(let range):
                    if let normalized = normalizer.apply(bytes, range) {
                        normalized.withUnsafeBufferPointer { text in
                            encodeNormalized(text, 0..<text.count, second: &second, pieces: &pieces, into: &ids)
                        }
                    } else {
                        encodeNormalized(bytes, range, second: &second, pieces: &pieces, into: &ids)
                    }
                }
            }
            return ids
        }
    }

    /// Normalized text between the non-normalized added tokens: the normalized added tokens split
    /// off, the rest pre-tokenized and through the model.
    private func encodeNormalized(_ bytes: UnsafeBufferPointer<UInt8>, _ range: Range<Int>, second: inout [Segment],
                                  pieces: inout [Range<Int>], into ids: inout [Int32]) {
        second.removeAll(keepingCapacity: true)
        secondPass.split(bytes, range, into: &second)
        for inner in second {
            switch inner {
            case .token(let id): ids.append(id)
            case .text(let range): encodeText(bytes, range, pieces: &pieces, into: &ids)
            }
        }
    }

    /// Text between added tokens: pre-tokenized, then each piece through the model.
    private func encodeText(_ bytes: UnsafeBufferPointer<UInt8>, _ range: Range<Int>,
                            pieces: inout [Range<Int>], into ids: inout [Int32]) {
        if case .byteLevel(addPrefixSpace: true, _) = preTokenizer, !range.isEmpty, bytes[range.lowerBound] != 0x20 {
            var spaced: [UInt8] = [0x20]
            spaced.append(contentsOf: bytes[range])
            spaced.withUnsafeBufferPointer { encodePieces($0, 0..<$0.count, pieces: &pieces, into: &ids) }
        } else {
            encodePieces(bytes, range, pieces: &pieces, into: &ids)
        }
    }

    private func encodePieces(_ bytes: UnsafeBufferPointer<UInt8>, _ range: Range<Int>,
                              pieces: inout [Range<Int>], into ids: inout [Int32]) {
        pieces.removeAll(keepingCapacity: true)
        preTokenizer.split(bytes, range, into: &pieces)
        switch model {
        case .bpe(let bpe):
            for piece in pieces {
                if cache.lookup(bytes, piece, into: &ids) { continue }
                let before = ids.count
                bpe.encode(bytes, piece, into: &ids)
                cache.store(bytes, piece, ids[before...])
            }
        case .wordLevel(let wordLevel):
            for piece in pieces { wordLevel.encode(bytes, piece, into: &ids) }
        }
    }

    // MARK: Decoding

    /// The text of `ids`, as the tokenizers library's `decode`: ids no token has are left out,
    /// special tokens too with `skipSpecialTokens`; byte-level tokens are turned back into bytes
    /// and read as UTF-8 (ill-formed bytes become U+FFFD); without a decoder the tokens are
    /// joined with spaces.
    public func decode(_ ids: [Int32], skipSpecialTokens: Bool = false) -> String {
        var stream = streamingDecoder(skipSpecialTokens: skipSpecialTokens)
        var text = stream.push(ids)
        text += stream.finish()
        return text
    }

    /// A decoder for ids that arrive one at a time; see `StreamingDecoder`.
    public func streamingDecoder(skipSpecialTokens: Bool = false) -> StreamingDecoder {
        StreamingDecoder(tokenizer: self, skipSpecialTokens: skipSpecialTokens)
    }

    func hasToken(_ id: Int32) -> Bool {
        id >= 0 && Int(id) < tokenText.count && tokenText[Int(id)] != nil
    }
}

/// Decodes ids as they arrive. `push` returns the text that is certain: bytes that do not yet form
/// a whole UTF-8 character are held back until a later token completes them (or `finish` shows
/// they never will), so no replacement character is ever shown that a later token would have
/// completed. The concatenation of every `push` and `finish` equals `Tokenizer.decode` of all ids.
public struct StreamingDecoder: Sendable {
    private let tokenizer: Tokenizer
    private let skipSpecialTokens: Bool
    private var pending: [UInt8] = []
    private var started = false

    init(tokenizer: Tokenizer, skipSpecialTokens: Bool) {
        self.tokenizer = tokenizer
        self.skipSpecialTokens = skipSpecialTokens
    }

    /// Bytes held back, waiting for the rest of their character.
    public var heldBackByteCount: Int { pending.count }

    public mutating func push(_ id: Int32) -> String { push([id]) }

    public mutating func push(_ ids: [Int32]) -> String {
        switch tokenizer.decoder {
        case .byteLevel:
            for id in ids where accepts(id) { pending.append(contentsOf: tokenizer.tokenBytes[Int(id)]) }
            return flush(final: false)
        case .none:
            var text = ""
            for id in ids where accepts(id) {
                if started { text += " " }
                text += tokenizer.tokenText[Int(id)]!
                started = true
            }
            return text
        }
    }

    /// Whatever is still held back, ill-formed bytes replaced; the decoder can go on afterwards.
    public mutating func finish() -> String { flush(final: true) }

    private func accepts(_ id: Int32) -> Bool {
        tokenizer.hasToken(id) && !(skipSpecialTokens && tokenizer.specialTokenIDs.contains(id))
    }

    private mutating func flush(final: Bool) -> String {
        guard !pending.isEmpty else { return "" }
        var output: [UInt8] = []
        output.reserveCapacity(pending.count)
        let consumed = pending.withUnsafeBufferPointer { UTF8Lossy.decode($0, final: final, into: &output) }
        pending.removeFirst(consumed)
        return String(decoding: output, as: UTF8.self)
    }
}

/// Model output of recent pieces, keyed by their bytes; short pieces by two integers.
struct PieceCache {
    private struct ShortKey: Hashable {
        var low: UInt64
        var high: UInt64
    }

    private var short: [ShortKey: (start: Int32, count: Int32)] = [:]
    private var long: [[UInt8]: [Int32]] = [:]
    private var pool: [Int32] = []
    private static let capacity = 200_000
    private static let longestCached = 256

    private static func shortKey(_ bytes: UnsafeBufferPointer<UInt8>, _ range: Range<Int>) -> ShortKey? {
        guard range.count < 16 else { return nil }
        var low: UInt64 = 0, high: UInt64 = UInt64(range.count) << 56
        for (offset, index) in range.enumerated() {
            let byte = UInt64(bytes[index])
            if offset < 8 { low |= byte << (8 * UInt64(offset)) } else { high |= byte << (8 * UInt64(offset - 8)) }
        }
        return ShortKey(low: low, high: high)
    }

    mutating func lookup(_ bytes: UnsafeBufferPointer<UInt8>, _ range: Range<Int>, into ids: inout [Int32]) -> Bool {
        if let key = Self.shortKey(bytes, range) {
            guard let (start, count) = short[key] else { return false }
            ids.append(contentsOf: pool[Int(start)..<Int(start + count)])
            return true
        }
        guard range.count <= Self.longestCached, let found = long[Array(bytes[range])] else { return false }
        ids.append(contentsOf: found)
        return true
    }

    mutating func store(_ bytes: UnsafeBufferPointer<UInt8>, _ range: Range<Int>, _ result: ArraySlice<Int32>) {
        if short.count + long.count >= Self.capacity {
            short.removeAll(keepingCapacity: true)
            long.removeAll(keepingCapacity: true)
            pool.removeAll(keepingCapacity: true)
        }
        if let key = Self.shortKey(bytes, range) {
            short[key] = (Int32(pool.count), Int32(result.count))
            pool.append(contentsOf: result)
        } else if range.count <= Self.longestCached {
            long[Array(bytes[range])] = Array(result)
        }
    }
}
