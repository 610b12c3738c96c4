/// Proposals copied from the context: python/museflash/runtime/speculative.py's
/// `lookup_proposal`, the same rule (tests/runtime's goldens hold its answers on seeded
/// contexts, and the engine's decoding with it, for this copy to match).
///
/// The context's ending is the longest suffix of `minMatch ... maxMatch` tokens that also ends
/// at an earlier position among the newest `window`; among equally long matches the latest
/// wins. The proposal is what followed that earlier occurrence, copied on through the proposal
/// itself when it runs past the end, so a loop of period p repeats with period p.
public enum ContextLookup {
    /// The longest context ending compared.
    public static let maxMatch = 8
    /// Earlier occurrences are looked for among the newest this many positions.
    public static let window = 1024

    /// `count` tokens copied from where the context's ending occurred before, or nil.
    public static func proposal(_ context: [Int32], count: Int, minMatch: Int) -> [Int32]? {
        precondition(minMatch >= 1 && count >= 1, "lookup needs minMatch >= 1 and count >= 1")
        let tail = Array(context.suffix(window + maxMatch))
        let length = tail.count
        guard length >= 2 else { return nil }
        var best = 0
        var bestEnd = -1
        // Newest first, so a longer match must be strictly longer to replace one.
        for end in stride(from: length - 2, through: max(0, length - 1 - window), by: -1) {
            var matched = 0
            while matched < maxMatch, matched <= end, tail[end - matched] == tail[length - 1 - matched] {
                matched += 1
            }
            if matched > best {
                best = matched
                bestEnd = end
                if best == maxMatch { break }
            }
        }
        guard best >= minMatch else { return nil }
        var tokens = tail
        tokens.reserveCapacity(length + count)
        for index in 0..<count { tokens.append(tokens[bestEnd + 1 + index]) }
        return Array(tokens[length...])
    }
}
