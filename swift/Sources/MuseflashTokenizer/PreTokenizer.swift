/// The pre-tokenizers museflash's tokenizers use, written out by hand over Unicode scalars.
enum PreTokenizer: Equatable {
    /// ByteLevel: with `useRegex`, GPT-2's split
    /// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
    /// (Oniguruma semantics: `\s` is Unicode White_Space); with `addPrefixSpace`, a space goes
    /// in front of every piece of text between added tokens that does not start with one.
    case byteLevel(addPrefixSpace: Bool, useRegex: Bool)
    /// Sequence[Split(pattern, Isolated), ByteLevel(add_prefix_space=false, use_regex=false)]
    /// with Llama 3's pattern (`digitsPerPiece` 3) or Qwen2's (1), which differ only in `\p{N}{1,3}`
    /// against `\p{N}`:
    /// `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
    /// (Oniguruma semantics, as the tokenizers library runs it: `\s` is White_Space, `\p{L}` and
    /// `\p{N}` the general categories, `(?i:...)` Unicode case folding, which lets U+017F stand for
    /// s). The pattern matches at every position, so the pieces are its matches.
    case splitThenByteLevel(digitsPerPiece: Int)
    /// Sequence[Digits(individual_digits=true), ByteLevel(add_prefix_space=false)], as SmolLM2
    /// writes it (llama.cpp's "smollm" pre-tokenizer): every number scalar (general category N,
    /// Rust's `char::is_numeric`) is a piece of its own, and the text between them is split as
    /// ByteLevel splits it (GPT-2's pattern with `useRegex`).
    case digitsThenByteLevel(useRegex: Bool)

    static let llama3Pattern = #"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"#
    static let qwen2Pattern = #"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"#
    /// Whitespace: the matches of `\w+|[^\w\s]+` (Rust regex semantics: `\w` is Alphabetic, marks,
    /// decimal digits, connector punctuation and join controls; `\s` is White_Space).
    case whitespace

    /// Appends the pieces of `bytes[range]` (valid UTF-8) to `pieces`.
    func split(_ bytes: UnsafeBufferPointer<UInt8>, _ range: Range<Int>, into pieces: inout [Range<Int>]) {
        switch self {
        case .byteLevel(_, let useRegex):
            if !useRegex {
                if !range.isEmpty { pieces.append(range) }
            } else {
                Self.gpt2Split(bytes, range, into: &pieces)
            }
        case .splitThenByteLevel(let digitsPerPiece):
            var start = range.lowerBound
            while start < range.upperBound {
                let stop = splitMatch(bytes, at: start, end: range.upperBound, digits: digitsPerPiece)
                pieces.append(start..<stop)
                start = stop
            }
        case .whitespace:
            Self.whitespaceSplit(bytes, range, into: &pieces)
        case .digitsThenByteLevel(let useRegex):
            let text = PreTokenizer.byteLevel(addPrefixSpace: false, useRegex: useRegex)
            var start = range.lowerBound
            var index = start
            while index < range.upperBound {
                let (kind, length) = Self.gpt2Class(bytes, at: index)
                if kind == .number {
                    text.split(bytes, start..<index, into: &pieces)
                    pieces.append(index..<index + length)
                    start = index + length
                }
                index += length
            }
            text.split(bytes, start..<range.upperBound, into: &pieces)
        }
    }

    // MARK: Scalars

    /// GPT-2 classes: L, N, White_Space, or anything else.
    enum Class: UInt8 { case letter, number, space, other }

    private static let asciiClass: [Class] = (0..<128).map { value in
        let scalar = Unicode.Scalar(UInt8(value))
        return classify(scalar)
    }

    static func classify(_ scalar: Unicode.Scalar) -> Class {
        let properties = scalar.properties
        if properties.isWhitespace { return .space }
        switch properties.generalCategory {
        case .uppercaseLetter, .lowercaseLetter, .titlecaseLetter, .modifierLetter, .otherLetter:
            return .letter
        case .decimalNumber, .letterNumber, .otherNumber:
            return .number
        default:
            return .other
        }
    }

    /// The scalar starting at `index` (valid UTF-8) and its length in bytes.
    @inline(__always)
    static func scalar(_ bytes: UnsafeBufferPointer<UInt8>, at index: Int) -> (value: UInt32, length: Int) {
        let lead = UInt32(bytes[index])
        if lead < 0x80 { return (lead, 1) }
        if lead < 0xE0 {
            return ((lead & 0x1F) << 6 | UInt32(bytes[index + 1] & 0x3F), 2)
        }
        if lead < 0xF0 {
            return ((lead & 0x0F) << 12 | UInt32(bytes[index + 1] & 0x3F) << 6 | UInt32(bytes[index + 2] & 0x3F), 3)
        }
        return ((lead & 0x07) << 18 | UInt32(bytes[index + 1] & 0x3F) << 12
                | UInt32(bytes[index + 2] & 0x3F) << 6 | UInt32(bytes[index + 3] & 0x3F), 4)
    }

    @inline(__always)
    static func gpt2Class(_ bytes: UnsafeBufferPointer<UInt8>, at index: Int) -> (Class, Int) {
        let byte = bytes[index]
        if byte < 0x80 { return (asciiClass[Int(byte)], 1) }
        let (value, length) = scalar(bytes, at: index)
        return (classify(Unicode.Scalar(value)!), length)
    }

    // MARK: GPT-2

    static func gpt2Split(_ bytes: UnsafeBufferPointer<UInt8>, _ range: Range<Int>, into pieces: inout [Range<Int>]) {
        let end = range.upperBound
        var start = range.lowerBound
        while start < end {
            let stop = gpt2Match(bytes, at: start, end: end)
            pieces.append(start..<stop)
            start = stop
        }
    }

    /// The end of the regex's match at `start` (the regex matches at every position).
    @inline(__always)
    private static func gpt2Match(_ bytes: UnsafeBufferPointer<UInt8>, at start: Int, end: Int) -> Int {
        let first = bytes[start]
        // 's 't 're 've 'm 'll 'd
        if first == 0x27, start + 1 < end {
            switch bytes[start + 1] {
            case UInt8(ascii: "s"), UInt8(ascii: "t"), UInt8(ascii: "m"), UInt8(ascii: "d"):
                return start + 2
            case UInt8(ascii: "r"), UInt8(ascii: "v"):
                if start + 2 < end, bytes[start + 2] == UInt8(ascii: "e") { return start + 3 }
            case UInt8(ascii: "l"):
                if start + 2 < end, bytes[start + 2] == UInt8(ascii: "l") { return start + 3 }
            default:
                break
            }
        }
        var (cls, length) = gpt2Class(bytes, at: start)
        var runStart = start
        // ` ?\p{L}+`, ` ?\p{N}+`, ` ?[^\s\p{L}\p{N}]+`: a space followed by a run of one class.
        if first == 0x20, start + 1 < end {
            let (next, nextLength) = gpt2Class(bytes, at: start + 1)
            if next != .space {
                cls = next
                length = nextLength
                runStart = start + 1
            }
        }
        if cls != .space {
            var index = runStart + length
            while index < end {
                let (c, l) = gpt2Class(bytes, at: index)
                guard c == cls else { break }
                index += l
            }
            return index
        }
        // `\s+(?!\S)|\s+`: the whole run when it ends the text, else all but its last scalar
        // (which then starts the next piece), but at least one scalar.
        var index = start + length
        var last = start
        while index < end {
            let (c, l) = gpt2Class(bytes, at: index)
            guard c == .space else { break }
            last = index
            index += l
        }
        if index == end || last == start { return index }
        return last
    }

    // MARK: Llama 3 / Qwen2 split

    @inline(__always)
    private static func isNewline(_ byte: UInt8) -> Bool { byte == 0x0A || byte == 0x0D }

    /// The end of the run of `cls` scalars starting at `index`.
    @inline(__always)
    private static func runEnd(_ bytes: UnsafeBufferPointer<UInt8>, from index: Int, end: Int, of cls: Class) -> Int {
        var index = index
        while index < end {
            let (c, l) = gpt2Class(bytes, at: index)
            guard c == cls else { break }
            index += l
        }
        return index
    }

    /// The scalar at `index` case-folded when it folds to an ASCII letter (ASCII letters, and
    /// U+017F LATIN SMALL LETTER LONG S, which folds to s), with its length; nil otherwise.
    @inline(__always)
    private static func foldedLetter(_ bytes: UnsafeBufferPointer<UInt8>, at index: Int, end: Int) -> (UInt8, Int)? {
        let byte = bytes[index]
        if byte >= 0x41 && byte <= 0x5A { return (byte | 0x20, 1) }
        if byte >= 0x61 && byte <= 0x7A { return (byte, 1) }
        if byte == 0xC5, index + 1 < end, bytes[index + 1] == 0xBF { return (UInt8(ascii: "s"), 2) }
        return nil
    }

    private static let contractions: [[UInt8]] = ["s", "t", "re", "ve", "m", "ll", "d"].map { Array($0.utf8) }

    /// `(?i:'s|'t|'re|'ve|'m|'ll|'d)` after the apostrophe at `start`: the end of the match, if any.
    private static func contractionEnd(_ bytes: UnsafeBufferPointer<UInt8>, at start: Int, end: Int) -> Int? {
        for word in contractions {
            var index = start + 1
            var matched = true
            for letter in word {
                guard index < end, let (folded, length) = foldedLetter(bytes, at: index, end: end), folded == letter else {
                    matched = false
                    break
                }
                index += length
            }
            if matched { return index }
        }
        return nil
    }

    /// The end of the split pattern's match at `start` (it matches at every position).
    private func splitMatch(_ bytes: UnsafeBufferPointer<UInt8>, at start: Int, end: Int, digits: Int) -> Int {
        let first = bytes[start]
        if first == 0x27, let stop = Self.contractionEnd(bytes, at: start, end: end) { return stop }
        let (cls, length) = Self.gpt2Class(bytes, at: start)
        let next = start + length
        // `[^\r\n\p{L}\p{N}]?\p{L}+`: letters, or one scalar of another kind (not a number or
        // newline; spaces included) followed by letters.
        if cls == .letter {
            return Self.runEnd(bytes, from: next, end: end, of: .letter)
        }
        if cls != .number, !Self.isNewline(first), next < end, Self.gpt2Class(bytes, at: next).0 == .letter {
            return Self.runEnd(bytes, from: next, end: end, of: .letter)
        }
        // `\p{N}{1,3}` (or `\p{N}`)
        if cls == .number {
            var index = next
            var count = 1
            while index < end, count < digits {
                let (c, l) = Self.gpt2Class(bytes, at: index)
                guard c == .number else { break }
                index += l
                count += 1
            }
            return index
        }
        // ` ?[^\s\p{L}\p{N}]+[\r\n]*`
        var otherStart = -1
        if cls == .other {
            otherStart = start
        } else if first == 0x20, next < end, Self.gpt2Class(bytes, at: next).0 == .other {
            otherStart = next
        }
        if otherStart >= 0 {
            var index = Self.runEnd(bytes, from: otherStart, end: end, of: .other)
            while index < end, Self.isNewline(bytes[index]) { index += 1 }
            return index
        }
        // A whitespace run. `\s*[\r\n]+`: up to its last newline, when it has one;
        // `\s+(?!\S)|\s+`: the whole run when it ends the text, else all but its last scalar
        // (which then starts the next piece), but at least one scalar.
        var index = start
        var last = start
        var lastNewline = -1
        while index < end {
            let (c, l) = Self.gpt2Class(bytes, at: index)
            guard c == .space else { break }
            if Self.isNewline(bytes[index]) { lastNewline = index }
            last = index
            index += l
        }
        if lastNewline >= 0 { return lastNewline + 1 }
        if index == end || last == start { return index }
        return last
    }

    // MARK: Whitespace

    enum WordClass: UInt8 { case word, space, other }

    private static let asciiWordClass: [WordClass] = (0..<128).map { wordClassify(Unicode.Scalar(UInt8($0))) }

    private static func wordClassify(_ scalar: Unicode.Scalar) -> WordClass {
        let properties = scalar.properties
        if properties.isWhitespace { return .space }
        if properties.isAlphabetic || properties.isJoinControl { return .word }
        switch properties.generalCategory {
        case .nonspacingMark, .spacingMark, .enclosingMark, .decimalNumber, .connectorPunctuation:
            return .word
        default:
            return .other
        }
    }

    @inline(__always)
    static func wordClass(_ bytes: UnsafeBufferPointer<UInt8>, at index: Int) -> (WordClass, Int) {
        let byte = bytes[index]
        if byte < 0x80 { return (asciiWordClass[Int(byte)], 1) }
        let (value, length) = scalar(bytes, at: index)
        return (wordClassify(Unicode.Scalar(value)!), length)
    }

    static func whitespaceSplit(_ bytes: UnsafeBufferPointer<UInt8>, _ range: Range<Int>, into pieces: inout [Range<Int>]) {
        let end = range.upperBound
        var index = range.lowerBound
        while index < end {
            let (cls, length) = wordClass(bytes, at: index)
            if cls == .space {
                index += length
                continue
            }
            let start = index
            index += length
            while index < end {
                let (c, l) = wordClass(bytes, at: index)
                guard c == cls else { break }
                index += l
            }
            pieces.append(start..<index)
        }
    }
}
