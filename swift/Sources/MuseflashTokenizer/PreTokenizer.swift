/// The two pre-tokenizers museflash's tokenizers use, written out by hand over Unicode scalars.
enum PreTokenizer: Equatable {
    /// ByteLevel: with `useRegex`, GPT-2's split
    /// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
    /// (Oniguruma semantics: `\s` is Unicode White_Space); with `addPrefixSpace`, a space goes
    /// in front of every piece of text between added tokens that does not start with one.
    case byteLevel(addPrefixSpace: Bool, useRegex: Bool)
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
        case .whitespace:
            Self.whitespaceSplit(bytes, range, into: &pieces)
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
    private static func gpt2Class(_ bytes: UnsafeBufferPointer<UInt8>, at index: Int) -> (Class, Int) {
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
