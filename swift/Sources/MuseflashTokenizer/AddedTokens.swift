/// An entry of tokenizer.json's `added_tokens`.
struct AddedToken {
    var id: Int32
    var content: String
    var bytes: [UInt8]
    var singleWord: Bool
    var lstrip: Bool
    var rstrip: Bool
    var normalized: Bool
    var special: Bool
}

/// A piece of the input: an added token's id, or text for the pre-tokenizer and model.
enum Segment {
    case token(Int32)
    case text(Range<Int>)
}

/// Finds added tokens in text as the tokenizers library does: leftmost-longest matches over
/// the bytes, continuing after each match, then `single_word`, `lstrip` and `rstrip` applied.
struct AddedTokenMatcher {
    private let tokens: [AddedToken]
    /// first byte -> indices into `tokens`, longest content first.
    private let byFirstByte: [[Int]]

    var isEmpty: Bool { tokens.isEmpty }

    init(_ tokens: [AddedToken]) {
        let kept = tokens.filter { !$0.bytes.isEmpty }
        var table = [[Int]](repeating: [], count: 256)
        for (index, token) in kept.enumerated() { table[Int(token.bytes[0])].append(index) }
        self.tokens = kept
        byFirstByte = table.map { list in list.sorted { kept[$0].bytes.count > kept[$1].bytes.count } }
    }

    private func match(_ bytes: UnsafeBufferPointer<UInt8>, from: Int, to end: Int) -> (start: Int, token: Int)? {
        var position = from
        while position < end {
            for index in byFirstByte[Int(bytes[position])] {
                let content = tokens[index].bytes
                guard position + content.count <= end else { continue }
                var equal = true
                for offset in 1..<content.count where bytes[position + offset] != content[offset] {
                    equal = false
                    break
                }
                if equal { return (position, index) }
            }
            position += 1
        }
        return nil
    }

    /// Splits `bytes[range]` into added tokens and the text between them; empty text is left out.
    func split(_ bytes: UnsafeBufferPointer<UInt8>, _ range: Range<Int>, into segments: inout [Segment]) {
        if tokens.isEmpty {
            if !range.isEmpty { segments.append(.text(range)) }
            return
        }
        let low = range.lowerBound, high = range.upperBound
        var offset = low  // end of what is already split off
        var scan = low    // where the next match is looked for
        while let (matchStart, index) = match(bytes, from: scan, to: high) {
            let token = tokens[index]
            var start = matchStart
            var stop = matchStart + token.bytes.count
            scan = stop
            if token.singleWord {
                let alone = (start == low || !Self.isWord(bytes, at: Self.scalarStart(bytes, before: start, from: low)))
                    && (stop == high || !Self.isWord(bytes, at: stop))
                if !alone { continue }
            }
            if token.lstrip {
                var index = start
                while index > low {
                    let previous = Self.scalarStart(bytes, before: index, from: low)
                    guard Self.isSpace(bytes, at: previous) else { break }
                    index = previous
                }
                start = max(index, offset)
            }
            if token.rstrip {
                while stop < high, Self.isSpace(bytes, at: stop) {
                    stop += PreTokenizer.scalar(bytes, at: stop).length
                }
            }
            if offset < start { segments.append(.text(offset..<start)) }
            segments.append(.token(token.id))
            offset = stop
        }
        if offset < high { segments.append(.text(offset..<high)) }
    }

    // MARK: Rust regex `\w` and `\s`, as the library's single_word / strip checks use them

    private static func scalarStart(_ bytes: UnsafeBufferPointer<UInt8>, before index: Int, from low: Int) -> Int {
        var start = index - 1
        while start > low, bytes[start] & 0xC0 == 0x80 { start -= 1 }
        return start
    }

    private static func isSpace(_ bytes: UnsafeBufferPointer<UInt8>, at index: Int) -> Bool {
        PreTokenizer.wordClass(bytes, at: index).0 == .space
    }

    private static func isWord(_ bytes: UnsafeBufferPointer<UInt8>, at index: Int) -> Bool {
        PreTokenizer.wordClass(bytes, at: index).0 == .word
    }
}
