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

    /// The target's likeliest next tokens after each token it has been called on.
    public final class RecycledTable {
        public let topK: Int
        public private(set) var rows: [Int32: (ids: [Int32], logProbabilities: [Double])] = [:]

        public init(topK: Int = TokenTree.recycledTopK) { self.topK = topK }

        /// Remembers, for each token, the topK of the target's logits on its row.
        public func update(tokens: [Int32], logits: [[Float]]) {
            for (token, row) in zip(tokens, logits) { rows[token] = TokenTree.topLogProbabilities(row, k: topK) }
        }

        public func successors(of token: Int32) -> (ids: [Int32], logProbabilities: [Double]) {
            rows[token] ?? ([], [])
        }
    }

    /// The k likeliest ids of a logits row and their log-probabilities, likeliest first,
    /// equal ones by smaller id.
    public static func topLogProbabilities(_ logits: [Float], k: Int) -> (ids: [Int32], logProbabilities: [Double]) {
        let row = logits.map(Double.init)
        guard let top = row.max() else { return ([], []) }
        let logTotal = top + log(row.reduce(0) { $0 + exp($1 - top) })
        let order = row.indices.sorted { row[$0] != row[$1] ? row[$0] > row[$1] : $0 < $1 }.prefix(k)
        return (order.map { Int32($0) }, order.map { row[$0] - logTotal })
    }

    /// The tree of at most `budget` nodes (the root included) with the best scores.
    /// `draftLogits[d - 1]`: the drafter's logits at depth d. No node is deeper than `maxDepth`
    /// (the drafter's rows by default; unbounded with neither).
    public static func build(anchor: Int32, budget: Int, draftLogits: [[Float]]? = nil,
                             recycled: RecycledTable? = nil, lookup: [Int32]? = nil, maxDepth: Int? = nil,
                             draftTopK: Int = TokenTree.draftTopK,
                             lookupProbability: Double = TokenTree.lookupProbability,
                             recycledWeight: Double = TokenTree.recycledWeight) throws -> TokenTree {
        try build(anchor: anchor, budget: budget, draftRows: draftLogits.map { $0.map { topLogProbabilities($0, k: draftTopK) } },
                  recycled: recycled, lookup: lookup, maxDepth: maxDepth, lookupProbability: lookupProbability,
                  recycledWeight: recycledWeight)
    }

    /// `build` on the drafter's rows already cut to their likeliest tokens
    /// (`topLogProbabilities`): `draftRows[d - 1]` at depth d.
    public static func build(anchor: Int32, budget: Int, draftRows: [(ids: [Int32], logProbabilities: [Double])]?,
                             recycled: RecycledTable? = nil, lookup: [Int32]? = nil, maxDepth: Int? = nil,
                             lookupProbability: Double = TokenTree.lookupProbability,
                             recycledWeight: Double = TokenTree.recycledWeight) throws -> TokenTree {
        guard budget >= 1 else { throw RuntimeError.badTree(reason: "a tree budget is at least 1 node (the root), got \(budget)") }
        let rows = draftRows ?? []
        let depthLimit = maxDepth ?? (draftRows != nil ? rows.count : nil)
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
        var children = Set<[Int64]>()
        var candidates: [Candidate] = []

        func pushChildren(_ node: Int) {
            let depth = depths[node] + 1
            if let limit = depthLimit, depth > limit { return }
            let score = scores[node]
            if depth <= rows.count {
                for (token, logp) in zip(rows[depth - 1].ids, rows[depth - 1].logProbabilities) {
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

        pushChildren(0)
        while !candidates.isEmpty, tokens.count < budget {
            var best = 0
            for index in 1..<candidates.count where candidates[index].before(candidates[best]) { best = index }
            let pick = candidates.remove(at: best)
            guard children.insert([Int64(pick.parent), Int64(pick.token)]).inserted else { continue }
            let node = tokens.count
            tokens.append(pick.token)
            parents.append(pick.parent)
            sources.append(pick.source)
            depths.append(depths[pick.parent] + 1)
            scores.append(pick.score)
            let depth = depths[node]
            onLookup.append(onLookup[pick.parent] && depth <= lookup.count && lookup[depth - 1] == pick.token)
            pushChildren(node)
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
        var child: [[Int64]: Int] = [:]
        for node in 1..<count { child[[Int64(parents[node]), Int64(tokens[node])]] = node }
        var path: [Int] = []
        var node = 0
        while let next = child[[Int64(node), Int64(choices[node])]] {
            path.append(next)
            node = next
        }
        return (path, choices[node])
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
