import Foundation

/// Token trees for speculative verification: python/museflash/runtime/tree.py's, the same rule
/// (tests/runtime's goldens hold the Python builder's trees on seeded draft rows, tables and
/// lookups, for this copy to match node for node). docs/trees.md says how a tree is used.
///
/// Node 0 is the anchor; every other node's parent is an earlier node. A node's score is the
/// product along its path of each edge's probability: the largest any source gives the edge
/// (the drafter's row, the recycled table's times `recycledWeight`, or `lookupProbability` on
/// the lookup chain). The
/// tree grows best first within a node budget; equal scores go to the smaller parent index,
/// then the smaller token id, then the source listed first.
public struct TokenTree: Equatable, Sendable {
    public enum Source: Int8, Sendable {
        case root = 0, drafter = 1, recycled = 2, lookup = 3
    }

    /// A drafter row's likeliest tokens a node may take.
    public static let draftTopK = 8
    /// The target's likeliest next tokens the recycled table keeps per token.
    public static let recycledTopK = 8
    /// The probability given to each edge of the lookup chain.
    public static let lookupProbability = 0.5
    /// What the recycled table's probabilities are multiplied by (tree.py RECYCLED_WEIGHT: the
    /// target's after a token in another context, measured to be overconfident).
    public static let recycledWeight = 0.3

    public let tokens: [Int32]
    public let parents: [Int]
    public let sources: [Source]

    public init(tokens: [Int32], parents: [Int], sources: [Source]) throws {
        guard !tokens.isEmpty, parents.count == tokens.count, sources.count == tokens.count else {
            throw RuntimeError.badTree(reason: "a tree needs one parent and one source per token, got \(tokens.count) tokens, \(parents.count) parents and \(sources.count) sources")
        }
        guard parents[0] == -1 else { throw RuntimeError.badTree(reason: "node 0 must be the root (parent -1)") }
        for node in 1..<tokens.count where !(0..<node).contains(parents[node]) {
            throw RuntimeError.badTree(reason: "node \(node)'s parent \(parents[node]) is not an earlier node")
        }
        self.tokens = tokens
        self.parents = parents
        self.sources = sources
    }

    /// The width-1 tree: the anchor, then each token below the one before.
    public static func chain(anchor: Int32, _ tokens: [Int32]) -> TokenTree {
        // swiftlint:disable:next force_try
        try! TokenTree(tokens: [anchor] + tokens, parents: Array(-1..<tokens.count),
                       sources: [.root] + Array(repeating: .drafter, count: tokens.count))
    }

    public var count: Int { tokens.count }

    /// 0 for the root, one more than its parent's for each node.
    public var depths: [Int] {
        var depths = [Int](repeating: 0, count: count)
        for node in 1..<count { depths[node] = depths[parents[node]] + 1 }
        return depths
    }

    /// Row i is true at i and at each of its ancestors: the nodes node i sees.
    public var ancestorMask: [[Bool]] {
        var mask = (0..<count).map { row in (0..<count).map { $0 == row } }
        for node in 1..<count {
            for column in 0..<node where mask[parents[node]][column] { mask[node][column] = true }
        }
        return mask
    }

    /// The nodes from the root's child down to `node` (empty for the root).
    public func path(to node: Int) -> [Int] {
        var nodes: [Int] = []
        var current = node
        while current > 0 {
            nodes.append(current)
            current = parents[current]
        }
        return nodes.reversed()
    }

    /// A row's likeliest ids and their log-probabilities, likeliest first.
    public typealias Top = (ids: [Int32], logProbabilities: [Double])

    /// The target's likeliest next tokens after each token it has been called on.
    public final class RecycledTable {
        public let topK: Int
        public private(set) var rows: [Int32: Top] = [:]

        public init(topK: Int = TokenTree.recycledTopK) { self.topK = topK }

        /// Remembers, for each token, the topK of the target's logits on its row.
        public func update(tokens: [Int32], logits: [[Float]]) {
            for (token, row) in zip(tokens, logits) { rows[token] = TokenTree.topLogProbabilities(row, k: topK) }
        }

        /// `update` from one call's logits, row i (`width` values from i * width) after
        /// `tokens[i]`: the rows cut to their topK on the cores at hand, no row copied; a later
        /// row of the same token replaces an earlier one, as in `update`.
        public func update(tokens: [Int32], logits: [Float], width: Int) {
            precondition(logits.count >= tokens.count * width, "\(tokens.count) rows of \(width) need that many logits")
            let tops = TokenTree.topLogProbabilities(rows: tokens.count, of: logits, width: width, k: topK)
            for (token, top) in zip(tokens, tops) { rows[token] = top }
        }

        public func successors(of token: Int32) -> Top {
            rows[token] ?? ([], [])
        }
    }

    /// The k likeliest ids of a logits row and their log-probabilities, likeliest first,
    /// equal ones by smaller id.
    public static func topLogProbabilities(_ logits: [Float], k: Int) -> Top {
        logits.withUnsafeBufferPointer { topLogProbabilities($0, k: k) }
    }

    /// `topLogProbabilities` of a row in place. One pass keeps the k best in a sorted list of k
    /// (a value enters only above the k-th, so most of the row costs one comparison: no sort of
    /// the row), a second adds up the softmax's denominator in float64 in index order.
    public static func topLogProbabilities(_ row: UnsafeBufferPointer<Float>, k: Int) -> Top {
        let k = min(k, row.count)
        guard k > 0 else { return ([], []) }
        var ids = [Int32](repeating: 0, count: k)
        var values = [Float](repeating: 0, count: k)
        var filled = 0
        var threshold = -Float.infinity
        for index in 0..<row.count {
            let value = row[index]
            if filled == k {
                // Equal to the k-th: a larger id, after it.
                guard value > threshold else { continue }
            } else if value.isNaN {
                continue
            }
            // Into its place; equal values keep the smaller id first.
            var slot = filled == k ? k - 1 : filled
            while slot > 0, values[slot - 1] < value {
                values[slot] = values[slot - 1]
                ids[slot] = ids[slot - 1]
                slot -= 1
            }
            values[slot] = value
            ids[slot] = Int32(index)
            if filled < k { filled += 1 }
            if filled == k { threshold = values[k - 1] }
        }
        guard filled > 0 else { return ([], []) }
        let top = Double(values[0])
        var total = 0.0
        for value in row { total += exp(Double(value) - top) }
        let logTotal = top + log(total)
        return (Array(ids[..<filled]), values[..<filled].map { Double($0) - logTotal })
    }

    /// `topLogProbabilities` of rows 0 ..< rows of `logits` (row i: `width` values from
    /// i * width), split across the cores: each row's figures are the same bits either way.
    public static func topLogProbabilities(rows: Int, of logits: [Float], width: Int, k: Int) -> [Top] {
        var tops = [Top](repeating: ([], []), count: rows)
        logits.withUnsafeBufferPointer { all in
            tops.withUnsafeMutableBufferPointer { buffer in
                let out = buffer  // each row writes its own element
                let body = { (row: Int) in
                    out[row] = topLogProbabilities(UnsafeBufferPointer(rebasing: all[(row * width)..<((row + 1) * width)]), k: k)
                }
                if rows > 1, ProcessInfo.processInfo.activeProcessorCount > 1 {
                    DispatchQueue.concurrentPerform(iterations: rows, execute: body)
                } else {
                    for row in 0..<rows { body(row) }
                }
            }
        }
        return tops
    }

    /// The tree of at most `budget` nodes (the root included) with the best scores.
    /// `draftLogits[d - 1]`: the drafter's logits at depth d. No node is deeper than `maxDepth`
    /// (the drafter's rows by default; unbounded with neither).
    public static func build(anchor: Int32, budget: Int, draftLogits: [[Float]]? = nil,
                             recycled: RecycledTable? = nil, lookup: [Int32]? = nil, maxDepth: Int? = nil,
                             draftTopK: Int = TokenTree.draftTopK,
                             lookupProbability: Double = TokenTree.lookupProbability,
                             recycledWeight: Double = TokenTree.recycledWeight) throws -> TokenTree {
        try build(anchor: anchor, budget: budget, draftDepth: draftLogits?.count,
                  draftRow: { topLogProbabilities(draftLogits![$0], k: draftTopK) },
                  recycled: recycled, lookup: lookup, maxDepth: maxDepth, lookupProbability: lookupProbability,
                  recycledWeight: recycledWeight)
    }

    /// `build` with the drafter's `draftDepth` rows (nil: none) cut to their likeliest tokens on
    /// demand: `draftRow(d - 1)` (`topLogProbabilities`) at depth d, asked once, and only when a
    /// node at depth d - 1 is placed while the budget has room for its children.
    public static func build(anchor: Int32, budget: Int, draftDepth: Int?, draftRow: (Int) -> Top,
                             recycled: RecycledTable? = nil, lookup: [Int32]? = nil, maxDepth: Int? = nil,
                             lookupProbability: Double = TokenTree.lookupProbability,
                             recycledWeight: Double = TokenTree.recycledWeight) throws -> TokenTree {
        guard budget >= 1 else { throw RuntimeError.badTree(reason: "a tree budget is at least 1 node (the root), got \(budget)") }
        let rowCount = draftDepth ?? 0
        var rows = [Top?](repeating: nil, count: rowCount)
        let depthLimit = maxDepth ?? draftDepth
        let lookup = lookup ?? []
        let lookupLog = log(lookupProbability)
        let recycledLog = log(recycledWeight)

        struct Candidate {
            let score: Double
            let parent: Int
            let token: Int32
            let source: Source
            /// The heap order of tree.py: higher score, then smaller parent, token, source.
            func before(_ other: Candidate) -> Bool {
                if score != other.score { return score > other.score }
                if parent != other.parent { return parent < other.parent }
                if token != other.token { return token < other.token }
                return source.rawValue < other.source.rawValue
            }
        }
        var tokens: [Int32] = [anchor], parents = [-1], sources: [Source] = [.root]
        var depths = [0], scores = [0.0], onLookup = [true]
        tokens.reserveCapacity(budget)
        parents.reserveCapacity(budget)
        sources.reserveCapacity(budget)
        depths.reserveCapacity(budget)
        scores.reserveCapacity(budget)
        onLookup.reserveCapacity(budget)
        // (parent, token) of the nodes placed, packed in one integer: no array per node.
        var children = Set<Int64>(minimumCapacity: budget)
        var candidates: [Candidate] = []
        candidates.reserveCapacity(64)

        func pushChildren(_ node: Int) {
            let depth = depths[node] + 1
            if let limit = depthLimit, depth > limit { return }
            let score = scores[node]
            if depth <= rowCount {
                let row: Top
                if let known = rows[depth - 1] {
                    row = known
                } else {
                    row = draftRow(depth - 1)
                    rows[depth - 1] = row
                }
                for (token, logp) in zip(row.ids, row.logProbabilities) {
                    candidates.append(Candidate(score: score + logp, parent: node, token: token, source: .drafter))
                }
            }
            if let recycled {
                let next = recycled.successors(of: tokens[node])
                for (token, logp) in zip(next.ids, next.logProbabilities) {
                    candidates.append(Candidate(score: score + logp + recycledLog, parent: node, token: token, source: .recycled))
                }
            }
            if onLookup[node], depth <= lookup.count {
                candidates.append(Candidate(score: score + lookupLog, parent: node, token: lookup[depth - 1], source: .lookup))
            }
        }

        if budget > 1 { pushChildren(0) }
        while !candidates.isEmpty, tokens.count < budget {
            var best = 0
            for index in 1..<candidates.count where candidates[index].before(candidates[best]) { best = index }
            let pick = candidates.remove(at: best)
            guard children.insert(Int64(pick.parent) << 32 | Int64(UInt32(bitPattern: pick.token))).inserted else { continue }
            let node = tokens.count
            tokens.append(pick.token)
            parents.append(pick.parent)
            sources.append(pick.source)
            depths.append(depths[pick.parent] + 1)
            scores.append(pick.score)
            let depth = depths[node]
            onLookup.append(onLookup[pick.parent] && depth <= lookup.count && lookup[depth - 1] == pick.token)
            // A full tree takes no more children: the loop ends here.
            if tokens.count < budget { pushChildren(node) }
        }
        return try TokenTree(tokens: tokens, parents: parents, sources: sources)
    }

    /// A sampled generation's tree (docs/trees.md, "Sampling"): this tree's shape with each
    /// node's token drawn from `q[depth - 1]`, the drafter's sampling distribution at its depth,
    /// without replacement among its siblings (an elder sibling's token is not drawn again), in
    /// node order. A node whose depth's distribution its elder siblings have exhausted is
    /// dropped with its subtree. The shape depends on the drafter alone, never on the target,
    /// so each node's children are sequential draws as `SpeculativeSampling.acceptTree` needs.
    public func filledBySampling(q: [[Double]], _ generator: inout SeededGenerator) throws -> TokenTree {
        var newTokens: [Int32] = [tokens[0]], newParents = [-1]
        var newIndex = [Int?](repeating: nil, count: count)
        newIndex[0] = 0
        var drawn: [Int: [Int32]] = [:]
        let depths = self.depths
        for node in 1..<count {
            guard let parent = newIndex[parents[node]], depths[node] <= q.count else { continue }
            var row = q[depths[node] - 1]
            for token in drawn[parent, default: []] { row[Int(token)] = 0 }
            guard row.reduce(0, +) > 0 else { continue }
            let token = Int32(SpeculativeSampling.sample(row, &generator))
            drawn[parent, default: []].append(token)
            newIndex[node] = newTokens.count
            newTokens.append(token)
            newParents.append(parent)
        }
        return try TokenTree(tokens: newTokens, parents: newParents,
                             sources: [.root] + Array(repeating: .drafter, count: newTokens.count - 1))
    }

    /// Each node's children, in node order.
    public var children: [[Int]] {
        var children = [[Int]](repeating: [], count: count)
        for node in 1..<count { children[parents[node]].append(node) }
        return children
    }

    /// The accepted nodes (root's child first) and the token after them, when `choices[i]` is
    /// the target's argmax after node i's path.
    public func acceptGreedy(choices: [Int32]) throws -> (path: [Int], token: Int32) {
        guard choices.count == count else { throw RuntimeError.badTree(reason: "\(choices.count) choices for a tree of \(count) nodes") }
        var path: [Int] = []
        var node = 0
        // The child holding the target's choice (the latest, were two alike): children come
        // after their parent.
        while let next = stride(from: count - 1, to: node, by: -1).first(where: { parents[$0] == node && tokens[$0] == choices[node] }) {
            path.append(next)
            node = next
        }
        return (path, choices[node])
    }

    /// The `tree_mask` of a tree call of `nodes` nodes (row-major, 1 where a node sees another):
    /// each node sees itself and its ancestors, and each pad node after the tree's sees the root
    /// and itself. `seesEarlierNodes`: each node sees every earlier node instead (a test's fault).
    public func treeMask(nodes: Int, seesEarlierNodes: Bool = false) -> [Int32] {
        precondition(nodes >= count, "a tree of \(count) nodes does not fit a call of \(nodes)")
        var mask = [Int32](repeating: 0, count: nodes * nodes)
        for row in 0..<count {
            if seesEarlierNodes {
                for column in 0...row { mask[row * nodes + column] = 1 }
                continue
            }
            var node = row
            while node >= 0 {
                mask[row * nodes + node] = 1
                node = parents[node]
            }
        }
        for row in count..<nodes {
            mask[row * nodes] = 1
            mask[row * nodes + row] = 1
        }
        return mask
    }

    /// Refuses a mask that is not some tree's ancestor mask: every node must see itself and the
    /// root, no later node, and exactly its parent's nodes besides itself, where its parent is
    /// the latest earlier node it sees. Returns the tree's parents.
    public static func parents(ofAncestorMask mask: [[Bool]]) throws -> [Int] {
        let count = mask.count
        guard count > 0, mask.allSatisfy({ $0.count == count }) else {
            throw RuntimeError.badTree(reason: "a tree mask is square and not empty, got \(count) rows of \(mask.map(\.count))")
        }
        var parents = [Int](repeating: -1, count: count)
        for node in 0..<count {
            let row = mask[node]
            guard row[node], row[0] else { throw RuntimeError.badTree(reason: "tree mask row \(node) does not see itself and the root (node 0)") }
            if let later = row[(node + 1)...].firstIndex(of: true) {
                throw RuntimeError.badTree(reason: "tree mask row \(node) sees a later node, \(later); nodes must come after their ancestors")
            }
            guard node > 0, let parent = row[..<node].lastIndex(of: true) else { continue }
            var expected = mask[parent]
            expected[node] = true
            guard row == expected else {
                throw RuntimeError.badTree(reason: "tree mask row \(node) sees nodes its parent, \(parent), does not: a node sees only its ancestors")
            }
            parents[node] = parent
        }
        return parents
    }
}
