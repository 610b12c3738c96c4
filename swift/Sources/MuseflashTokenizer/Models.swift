/// Byte-level BPE: a piece's bytes start as the 256 byte symbols and adjacent pairs merge by rank,
/// lowest rank first, leftmost first among equal ranks, until no pair has a merge.
struct BPEModel {
    /// Byte -> id of its symbol; -1 when the vocabulary lacks it.
    let byteIDs: [Int32]
    /// (left id << 32 | right id) -> (rank << 32 | merged id).
    let merges: [UInt64: UInt64]
    let unknownID: Int32?
    /// `ignore_merges`: a piece that is itself in the vocabulary is that token.
    let wholePieces: [String: Int32]?

    /// Pieces longer than this (in symbols) merge through a heap instead of rescanning.
    private static let shortWord = 48

    @inline(__always)
    private func merge(_ left: Int32, _ right: Int32) -> UInt64? {
        merges[UInt64(UInt32(bitPattern: left)) << 32 | UInt64(UInt32(bitPattern: right))]
    }

    /// Appends the ids of `bytes[range]`.
    func encode(_ bytes: UnsafeBufferPointer<UInt8>, _ range: Range<Int>, into ids: inout [Int32]) {
        if let wholePieces, let id = wholePieces[ByteLevel.spell(bytes[range])] {
            ids.append(id)
            return
        }
        var symbols: [Int32] = []
        symbols.reserveCapacity(range.count)
        for index in range {
            let id = byteIDs[Int(bytes[index])]
            if id >= 0 {
                symbols.append(id)
            } else if let unknownID {
                symbols.append(unknownID)
            }  // else dropped, as the tokenizers library drops a symbol it has no id for
        }
        if symbols.count <= Self.shortWord {
            mergeShort(&symbols)
            ids.append(contentsOf: symbols)
        } else {
            mergeLong(symbols, into: &ids)
        }
    }

    private func mergeShort(_ symbols: inout [Int32]) {
        while symbols.count > 1 {
            var best = UInt64.max
            var at = -1
            for index in 0..<(symbols.count - 1) {
                if let found = merge(symbols[index], symbols[index + 1]), found < best {
                    best = found
                    at = index
                }
            }
            guard at >= 0 else { return }
            symbols[at] = Int32(truncatingIfNeeded: best & 0xFFFF_FFFF)
            symbols.remove(at: at + 1)
        }
    }

    /// The same merges over a linked list with a heap of (rank, position) candidates.
    private func mergeLong(_ initial: [Int32], into ids: inout [Int32]) {
        var symbols = initial
        let count = symbols.count
        var next = Array(1...count)  // count means none
        var previous = Array(-1..<(count - 1))
        var alive = [Bool](repeating: true, count: count)
        var heap = MinHeap()
        for index in 0..<(count - 1) {
            if let found = merge(symbols[index], symbols[index + 1]) {
                heap.push((found >> 32) << 32 | UInt64(index))
            }
        }
        while let entry = heap.pop() {
            let rank = entry >> 32
            let at = Int(entry & 0xFFFF_FFFF)
            guard alive[at] else { continue }
            let right = next[at]
            guard right < count, let found = merge(symbols[at], symbols[right]), found >> 32 == rank else { continue }
            symbols[at] = Int32(truncatingIfNeeded: found & 0xFFFF_FFFF)
            alive[right] = false
            let after = next[right]
            next[at] = after
            if after < count { previous[after] = at }
            let before = previous[at]
            if before >= 0, let pair = merge(symbols[before], symbols[at]) {
                heap.push((pair >> 32) << 32 | UInt64(before))
            }
            if after < count, let pair = merge(symbols[at], symbols[after]) {
                heap.push((pair >> 32) << 32 | UInt64(at))
            }
        }
        var index = 0
        while index < count {
            ids.append(symbols[index])
            index = next[index]
        }
    }
}

/// A binary min-heap of UInt64.
struct MinHeap {
    private var items: [UInt64] = []

    mutating func push(_ value: UInt64) {
        items.append(value)
        var child = items.count - 1
        while child > 0 {
            let parent = (child - 1) / 2
            guard items[parent] > items[child] else { break }
            items.swapAt(parent, child)
            child = parent
        }
    }

    mutating func pop() -> UInt64? {
        guard let top = items.first else { return nil }
        let last = items.removeLast()
        if !items.isEmpty {
            items[0] = last
            var parent = 0
            while true {
                let left = 2 * parent + 1
                guard left < items.count else { break }
                var smallest = left
                if left + 1 < items.count, items[left + 1] < items[left] { smallest = left + 1 }
                guard items[smallest] < items[parent] else { break }
                items.swapAt(parent, smallest)
                parent = smallest
            }
        }
        return top
    }
}

/// WordLevel: a piece is its vocabulary entry, or the unknown token.
struct WordLevelModel {
    let vocabulary: [String: Int32]
    let unknownID: Int32

    func encode(_ bytes: UnsafeBufferPointer<UInt8>, _ range: Range<Int>, into ids: inout [Int32]) {
        let piece = String(decoding: UnsafeBufferPointer(rebasing: bytes[range]), as: UTF8.self)
        ids.append(vocabulary[piece] ?? unknownID)
    }
}
