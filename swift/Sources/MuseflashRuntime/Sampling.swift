import Foundation

/// Temperature and top-p sampling, and the speculative rejection rule (Leviathan et al. 2023,
/// Chen et al. 2023), as python/museflash/runtime/sampling.py states them:
///
///   - probabilities: softmax of logits / temperature; top-p keeps the smallest set of most
///     probable tokens whose mass reaches top_p (a token is kept when the mass strictly before
///     it, in descending order with ties by token id, is below top_p), renormalised. Greedy
///     (temperature 0) is the one-hot of the first maximum.
///   - sample: one uniform u in [0, 1) per row; the token is the number of cumulative sums
///     <= u * total (never a token without mass).
///   - accept: drafted token i (sampled from q_i) is accepted when u_i * q_i(x_i) < p_i(x_i),
///     with one uniform per drafted position drawn first; at the first rejection the token is
///     drawn from the normalised residual max(0, p - q), and when all are accepted the bonus
///     token from p_K. The output is then distributed exactly as the target's own sampling.
public struct Sampling: Sendable, Equatable {
    public var temperature: Double
    public var topP: Double

    public init(temperature: Double = 0, topP: Double = 1) throws {
        guard temperature.isFinite, temperature >= 0 else {
            throw RuntimeError.badOption(reason: "--temperature must be a finite number >= 0, got \(temperature)")
        }
        guard topP > 0, topP <= 1 else {
            throw RuntimeError.badOption(reason: "--top-p must be in (0, 1], got \(topP)")
        }
        self.temperature = temperature
        self.topP = topP
    }

    public var isGreedy: Bool { temperature == 0 }

    /// The distribution to sample from, for one row of logits.
    public func probabilities(_ logits: ArraySlice<Float>) -> [Double] {
        let values = Array(logits)
        var result = [Double](repeating: 0, count: values.count)
        if isGreedy {
            if !values.isEmpty { result[Int(argmax(logits))] = 1 }
            return result
        }
        let scaled = values.map { Double($0) / temperature }
        let peak = scaled.max() ?? 0
        var total = 0.0
        for (index, value) in scaled.enumerated() {
            result[index] = Foundation.exp(value - peak)
            total += result[index]
        }
        for index in result.indices { result[index] /= total }
        if topP == 1 { return result }
        let order = result.indices.sorted { result[$0] != result[$1] ? result[$0] > result[$1] : $0 < $1 }
        var before = 0.0
        var kept = 0.0
        var nucleus = [Double](repeating: 0, count: result.count)
        for index in order {
            if before >= topP { break }
            nucleus[index] = result[index]
            kept += result[index]
            before += result[index]
        }
        return nucleus.map { $0 / kept }
    }
}

/// The one source of randomness of a sampled generation: xoshiro256** (Blackman and Vigna)
/// seeded by SplitMix64 from a 64-bit seed; a uniform double is the top 53 bits of the next
/// output times 2^-53. Integer arithmetic only, so a seed gives the same tokens on every
/// platform.
public struct SeededGenerator: RandomNumberGenerator, Sendable {
    private var state: (UInt64, UInt64, UInt64, UInt64)

    public init(seed: UInt64) {
        var mix = seed
        func splitMix() -> UInt64 {
            mix &+= 0x9E37_79B9_7F4A_7C15
            var z = mix
            z = (z ^ (z >> 30)) &* 0xBF58_476D_1CE4_E5B9
            z = (z ^ (z >> 27)) &* 0x94D0_49BB_1331_11EB
            return z ^ (z >> 31)
        }
        state = (splitMix(), splitMix(), splitMix(), splitMix())
    }

    public mutating func next() -> UInt64 {
        let result = rotate(state.1 &* 5, 7) &* 9
        let shifted = state.1 << 17
        state.2 ^= state.0
        state.3 ^= state.1
        state.1 ^= state.2
        state.0 ^= state.3
        state.2 ^= shifted
        state.3 = rotate(state.3, 45)
        return result
    }

    private func rotate(_ value: UInt64, _ count: UInt64) -> UInt64 { (value << count) | (value >> (64 - count)) }

    /// A uniform double in [0, 1).
    public mutating func uniform() -> Double { Double(next() >> 11) * 0x1p-53 }
}

enum SpeculativeSampling {
    /// Deliberate damage to the tree rule, for the tests that show the statistical check sees
    /// it (SamplingTests).
    struct TreeFaults {
        /// After a rejected child, judge the next one (and draw the last token) against the
        /// node's own p instead of the residual.
        var keepTargetAfterRejection = false
        /// Judge every child against its depth's whole q, its elder siblings not removed.
        var ignoreDrawnSiblings = false
    }

    /// Multi-candidate speculative sampling over a tree (SpecInfer's recursive rejection, the
    /// candidates drawn without replacement): from the root, a node's children are judged in
    /// order. Child i, drawn from q_i (its depth's q without its elder siblings' tokens,
    /// renormalised), is accepted when u * q_i(x_i) < p_i(x_i), p_1 being the target's p at the
    /// node; on rejection p_{i+1} = max(0, p_i - q_i), normalised. An accepted child becomes the
    /// node; when every child is rejected, or the node has none, the token is drawn from the
    /// last p_i. Each step keeps the target's distribution (the rejection rule's lemma, child by
    /// child), so the output is distributed as the target's own sampling.
    /// `p(node)`: the target's distribution after the node's path; `q[d - 1]`: depth d's.
    static func acceptTree(_ tree: TokenTree, p: (Int) -> [Double], q: [[Double]], faults: TreeFaults = TreeFaults(),
                           _ generator: inout SeededGenerator) -> (path: [Int], token: Int32) {
        let children = tree.children
        let depths = tree.depths
        var path: [Int] = []
        var node = 0
        while true {
            let own = p(node)
            var target = own
            var drawn: [Int32] = []
            var next: Int?
            for child in children[node] {
                var proposal = q[depths[child] - 1]
                if !faults.ignoreDrawnSiblings {
                    for token in drawn { proposal[Int(token)] = 0 }
                }
                let mass = proposal.reduce(0, +)
                proposal = proposal.map { $0 / mass }
                let x = Int(tree.tokens[child])
                if generator.uniform() * proposal[x] < target[x] {
                    next = child
                    break
                }
                drawn.append(tree.tokens[child])
                if faults.keepTargetAfterRejection { continue }
                var residual = zip(target, proposal).map { Swift.max($0 - $1, 0) }
                let left = residual.reduce(0, +)
                // Zero only when target == proposal up to rounding, where a rejection has
                // probability ~0: keep the target then.
                if left > 0 {
                    residual = residual.map { $0 / left }
                    target = residual
                }
            }
            if let next {
                path.append(next)
                node = next
                continue
            }
            return (path, Int32(sample(target, &generator)))
        }
    }

    /// One token from `probabilities` (need not be normalised) by inverting the cumulative sum.
    static func sample(_ probabilities: [Double], _ generator: inout SeededGenerator) -> Int {
        var cumulative = [Double](repeating: 0, count: probabilities.count)
        var running = 0.0
        for (index, value) in probabilities.enumerated() {
            running += value
            cumulative[index] = running
        }
        let threshold = generator.uniform() * running
        let token = cumulative.reduce(0) { $0 + ($1 <= threshold ? 1 : 0) }
        if token < probabilities.count { return token }
        // u * total rounded up to total: the last token with mass.
        return probabilities.lastIndex { $0 > 0 } ?? probabilities.count - 1
    }

    /// The rejection step: p has K + 1 rows (row K is the bonus row), q and drafted K.
    /// Returns the drafts accepted and the token after them.
    static func accept(p: [[Double]], q: [[Double]], drafted: [Int32], _ generator: inout SeededGenerator) -> (accepted: Int, token: Int32) {
        let k = drafted.count
        // One uniform per position, drawn together; the ones after a rejection go unused.
        let uniforms = (0..<k).map { _ in generator.uniform() }
        var accepted = 0
        while accepted < k {
            let x = Int(drafted[accepted])
            if !(uniforms[accepted] * q[accepted][x] < p[accepted][x]) { break }
            accepted += 1
        }
        if accepted == k { return (k, Int32(sample(p[k], &generator))) }
        var residual = zip(p[accepted], q[accepted]).map { Swift.max($0 - $1, 0) }
        if !(residual.reduce(0, +) > 0) {
            // Only when p == q up to rounding, where a rejection has probability ~0.
            residual = p[accepted]
        }
        return (accepted, Int32(sample(residual, &generator)))
    }
}
