import ExportMetadata
import Foundation

/// A tree step of `SpeculativeDecoder` (docs/trees.md, "A tree step"), apart from the chain
/// and target-alone steps of SpeculativeDecoder.swift.
extension SpeculativeDecoder.Run {
    /// One tree step at `anchorPosition` (the type's docs, `tree`): -> the next anchor, its
    /// position, the drafts accepted, and, given `chainOf` (a chain's proposals, when the
    /// planner weighs the chain), how many the drafter's top-1 chain of that many would have
    /// accepted (at least; the planner's estimate for the chain).
    /// python/museflash/runtime/speculative.py `_tree_step`, call for call.
    mutating func treeStep(anchor: Int32, at anchorPosition: Int, budget: Int, copied: [Int32]?,
                           chainOf proposals: Int? = nil) throws -> (Int32, Int, Int, Int?) {
        let block = decoder.blockSize
        let vocab = decoder.vocabSize
        let drafted = try draft(anchor: anchor, at: anchorPosition)
        guard let draftLogits = drafted["logits"], draftLogits.count == block * vocab else {
            throw RuntimeError.badOutput(function: "draft", reason: "no logits of \(block) x \(vocab)")
        }
        var part = mark()
        // The draft's rows in place (no copies), row d at depth d.
        let draftValues = draftLogits.floats
        var q: [[Double]] = []
        if options.sampled, let sampling = options.sampling {
            q = (1..<block).map { probabilities(sampling, draftValues[($0 * vocab)..<(($0 + 1) * vocab)]) }
        }
        charge("top_k", of: .tree, since: part)
        part = mark()
        // Each depth's likeliest tokens, cut from its row when the tree first reaches it.
        let clock = decoder.clock
        var topSeconds = 0.0
        let draftRow = { (index: Int) -> TokenTree.Top in
            let start = clock.now()
            defer { topSeconds += clock.now() - start }
            return draftValues.withUnsafeBufferPointer {
                TokenTree.topLogProbabilities(UnsafeBufferPointer(rebasing: $0[((index + 1) * vocab)..<((index + 2) * vocab)]),
                                              k: TokenTree.draftTopK)
            }
        }
        var tree: TokenTree
        if options.sampled {
            // Sampled: the drafter's tree shape, its tokens drawn from the drafter's rows
            // (no recycled or copied candidates: each must come from the q it is judged by).
            tree = try TokenTree.build(anchor: anchor, budget: budget, draftDepth: block - 1, draftRow: draftRow, maxDepth: block - 1)
                .filledBySampling(q: q, &generator)
        } else {
            tree = try TokenTree.build(anchor: anchor, budget: budget, draftDepth: block - 1, draftRow: draftRow,
                                       recycled: decoder.recycled, lookup: copied, maxDepth: block - 1)
        }
        decoder.faults.treeHostWork?()
        // The tree's nodes, then pad nodes that only the root and themselves see.
        let nodes = decoder.treeLength, count = tree.count
        let depths = tree.depths + [Int](repeating: 1, count: nodes - count)
        let mask = tree.treeMask(nodes: nodes, seesEarlierNodes: decoder.faults.treeMaskSeesEarlierNodes)
        let inputs: [String: ShapedArray] = [
            "input_ids": ShapedArray(int32: tree.tokens + [Int32](repeating: pad, count: nodes - count), shape: [1, nodes]),
            "position_ids": ShapedArray(int32: depths.map { Int32(anchorPosition + $0) }, shape: [nodes]),
            "tree_mask": ShapedArray(int32: mask, shape: [nodes, nodes]),
        ]
        charge("top_k", of: .tree, seconds: topSeconds)
        charge("tree", of: .tree, since: part, besides: topSeconds)
        let outputs = try call(.tree, of: decoder.targetFunctions, inputs, first: anchorPosition, length: nodes)
        guard let logits = outputs["logits"], logits.count == nodes * vocab else {
            throw RuntimeError.badOutput(function: "tree", reason: "no logits of \(nodes) x \(vocab)")
        }
        guard let features = outputs["drafter_features"], features.count % nodes == 0, features.count > 0 else {
            throw RuntimeError.badOutput(function: "tree", reason: "no drafter_features of \(nodes) rows")
        }
        part = mark()
        let values = logits.floats
        let path: [Int], token: Int32
        if options.sampled, let sampling = options.sampling {
            // The generator apart from self while the closure reads self.
            var draws = generator
            (path, token) = SpeculativeSampling.acceptTree(tree, p: { probabilities(sampling, values[($0 * vocab)..<(($0 + 1) * vocab)]) },
                                                           q: q, faults: decoder.faults.treeSampling, &draws)
            generator = draws
        } else {
            let choices = (0..<count).map { argmax(values[($0 * vocab)..<(($0 + 1) * vocab)]) }
            (path, token) = try tree.acceptGreedy(choices: choices)
        }
        charge("accept", of: .tree, since: part)
        part = mark()
        let moves = path.enumerated().compactMap { index, node in
            node == index + 1 ? nil : (from: anchorPosition + node, to: anchorPosition + index + 1 + decoder.faults.treeMoveShift)
        }
        if !moves.isEmpty { try decoder.targetFunctions.state.moveRows(moves, inStates: decoder.targetStateNames) }
        result.movedRows += moves.count
        charge("move", of: .tree, since: part)
        part = mark()
        // Every node's row: the target's likeliest tokens after it, once for the whole call.
        decoder.recycled.update(tokens: tree.tokens, logits: values, width: vocab)
        charge("recycled", of: .tree, since: part)
        let accepted = path.count
        result.accepted.append(accepted)
        if copied != nil { result.lookupAccepted.append(accepted) }
        let taken = path.map { tree.tokens[$0] } + [token]
        emit(taken)
        var chain: Int?
        if let proposals {
            var matched = 0
            while matched < min(proposals, taken.count),
                  argmax(draftValues[((matched + 1) * vocab)..<((matched + 2) * vocab)]) == taken[matched] { matched += 1 }
            chain = matched
        }
        // The path's rows at their own positions; the inject window's positions past it (a
        // prompt shorter than a block) take the last path row as a placeholder.
        part = mark()
        let last = anchorPosition + accepted
        let width = features.count / nodes
        let featureValues = features.floats
        let pathRows = ([0] + path).map { featureValues[($0 * width)..<(($0 + 1) * width)] }
        for (offset, row) in pathRows.enumerated() { self.features[anchorPosition + offset] = row }
        try inject(first: max(0, last - block + 1), fallback: pathRows.last!)
        injectedThrough = last
        for position in self.features.keys where position <= last - block { self.features[position] = nil }
        charge("features", of: .tree, since: part)
        return (token, last + 1, accepted, chain)
    }
}
