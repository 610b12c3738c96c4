import Foundation
import MuseflashRuntime
import XCTest

/// The tree rules on hand-made cases (the goldens check the builder against Python on seeded
/// ones): masks that are not trees are refused, and greedy acceptance walks the target's
/// choices.
final class TokenTreeTests: XCTestCase {
    // root 7 -> {1: node 1, 2: node 2}; node 1 -> 3 (node 3); node 3 -> 4 (node 4); node 2 -> 5
    func tree() throws -> TokenTree {
        try TokenTree(tokens: [7, 1, 2, 3, 4, 5], parents: [-1, 0, 0, 1, 3, 2],
                      sources: [.root] + Array(repeating: .drafter, count: 5))
    }

    func testTheAncestorMaskGivesItsParentsBack() throws {
        let tree = try tree()
        XCTAssertEqual(tree.ancestorMask[4], [true, true, false, true, true, false])
        XCTAssertEqual(try TokenTree.parents(ofAncestorMask: tree.ancestorMask), tree.parents)
        XCTAssertEqual(tree.depths, [0, 1, 1, 2, 3, 2])
        XCTAssertEqual(tree.path(to: 4), [1, 3, 4])
    }

    func testAMaskThatIsNotATreeIsRefused() throws {
        let base = try tree().ancestorMask
        let edits: [(Int, Int, Bool, String)] = [(3, 2, true, "its parent"), (1, 4, true, "later node"),
                                                 (2, 0, false, "root"), (5, 5, false, "itself")]
        for (row, column, value, words) in edits {
            var mask = base
            mask[row][column] = value
            XCTAssertThrowsError(try TokenTree.parents(ofAncestorMask: mask)) { error in
                XCTAssertTrue("\(error)".contains(words), "\(error)")
            }
        }
        XCTAssertThrowsError(try TokenTree(tokens: [0, 1, 2], parents: [-1, 2, 0], sources: [.root, .drafter, .drafter]))
    }

    func testGreedyAcceptanceWalksTheTargetsChoices() throws {
        let tree = try tree()
        XCTAssertEqual(try tree.acceptGreedy(choices: [1, 3, 9, 4, 6, 0]).path, [1, 3, 4])
        XCTAssertEqual(try tree.acceptGreedy(choices: [1, 3, 9, 4, 6, 0]).token, 6)
        XCTAssertEqual(try tree.acceptGreedy(choices: [2, 3, 5, 4, 6, 8]).path, [2, 5])
        XCTAssertEqual(try tree.acceptGreedy(choices: [8, 3, 5, 4, 6, 0]).token, 8)
        XCTAssertThrowsError(try tree.acceptGreedy(choices: [1, 2]))
    }

    func testLookupAloneIsItsChainAndDepthIsBounded() throws {
        let lookup = try TokenTree.build(anchor: 9, budget: 3, lookup: [4, 5, 6])
        XCTAssertEqual(lookup.tokens, [9, 4, 5])
        XCTAssertEqual(lookup.parents, [-1, 0, 1])
        let flat = try TokenTree.build(anchor: 0, budget: 50, draftLogits: [[0, 0, 0], [0, 0, 0]])
        XCTAssertEqual(flat.count, 1 + 3 + 9)
        XCTAssertEqual(flat.depths.max(), 2)
        XCTAssertEqual(TokenTree.chain(anchor: 4, [5, 6]).parents, [-1, 0, 1])
    }

    /// The definition `topLogProbabilities` keeps without sorting a row: every id by its value,
    /// ties by smaller id, the first k; log-probabilities over the float64 softmax added in
    /// index order.
    static func sortedTop(_ logits: [Float], k: Int) -> TokenTree.Top {
        let row = logits.map(Double.init)
        guard let top = row.max() else { return ([], []) }
        let logTotal = top + Foundation.log(row.reduce(0) { $0 + Foundation.exp($1 - top) })
        let order = row.indices.sorted { row[$0] != row[$1] ? row[$0] > row[$1] : $0 < $1 }.prefix(k)
        return (order.map { Int32($0) }, order.map { row[$0] - logTotal })
    }

    func testTheLikeliestTokensAreTheSortsTiesAndAllToTheBit() {
        var generator = SeededGenerator(seed: 5)
        for trial in 0..<200 {
            // Few distinct values, so ties at and around the k-th are common; some rows
            // shorter than k, some rising (each value entering at the front), some falling.
            let length = [3, 8, 9, 64, 500][trial % 5]
            var row = (0..<length).map { _ in Float(Int(generator.uniform() * 6)) / 2 }
            if trial % 7 == 1 { row.sort() }
            if trial % 7 == 2 { row.sort(by: >) }
            for k in [1, 8] {
                let got = TokenTree.topLogProbabilities(row, k: k), want = Self.sortedTop(row, k: k)
                XCTAssertEqual(got.ids, want.ids, "row \(row), k \(k)")
                XCTAssertEqual(got.logProbabilities, want.logProbabilities, "row \(row), k \(k)")
            }
        }
        XCTAssertTrue(TokenTree.topLogProbabilities([], k: 8).ids.isEmpty)
        // Rows of one call at once, in place: each the same bits as alone.
        let rows = (0..<5).map { _ in (0..<300).map { _ in Float(Int(generator.uniform() * 40)) / 8 } }
        let together = TokenTree.topLogProbabilities(rows: 5, of: rows.flatMap { $0 }, width: 300, k: 8)
        for (row, top) in zip(rows, together) {
            XCTAssertEqual(top.ids, Self.sortedTop(row, k: 8).ids)
            XCTAssertEqual(top.logProbabilities, Self.sortedTop(row, k: 8).logProbabilities)
        }
    }

    func testTheRecycledTableTakesEachNodesRowInPlaceTheLaterReplacing() {
        let rows: [[Float]] = [[0, 3, 1, 2], [5, 0, 0, 1], [1, 1, 4, 0]]
        let copied = TokenTree.RecycledTable(topK: 2), inPlace = TokenTree.RecycledTable(topK: 2)
        // Token 7 twice: its later row is the one kept.
        copied.update(tokens: [7, 3, 7], logits: rows)
        inPlace.update(tokens: [7, 3, 7], logits: rows.flatMap { $0 }, width: 4)
        for token: Int32 in [7, 3] {
            XCTAssertEqual(inPlace.successors(of: token).ids, copied.successors(of: token).ids)
            XCTAssertEqual(inPlace.successors(of: token).logProbabilities, copied.successors(of: token).logProbabilities)
        }
        XCTAssertEqual(inPlace.successors(of: 7).ids, [2, 0])
    }

    func testTheDraftersRowsAreCutOnlyWhenTheTreeReachesThem() throws {
        let rows: [[Float]] = (0..<5).map { depth in (0..<6).map { Float(($0 * 7 + depth) % 6) } }
        for budget in [1, 2, 4, 9, 40] {
            var asked: [Int] = []
            let lazy = try TokenTree.build(anchor: 0, budget: budget, draftDepth: rows.count, draftRow: { depth in
                asked.append(depth)
                return TokenTree.topLogProbabilities(rows[depth], k: TokenTree.draftTopK)
            })
            let eager = try TokenTree.build(anchor: 0, budget: budget, draftLogits: rows)
            XCTAssertEqual(lazy, eager, "budget \(budget)")
            XCTAssertEqual(asked, Array(0..<asked.count), "each row once, shallow first")
            // A row is cut only for the children of a node placed while the tree had room: every
            // node but the one that filled it.
            let parents = lazy.depths.dropLast(lazy.count == budget ? 1 : 0)
            XCTAssertLessThanOrEqual(asked.count, min(rows.count, (parents.max() ?? -1) + 1), "budget \(budget)")
        }
    }

    func testTheTreeMaskIsTheAncestorMaskPadded() throws {
        let tree = try tree()
        let mask = tree.treeMask(nodes: 8)
        let ancestors = tree.ancestorMask
        for row in 0..<8 {
            for column in 0..<8 {
                let sees = row < tree.count ? column < tree.count && ancestors[row][column] : column == 0 || column == row
                XCTAssertEqual(mask[row * 8 + column], sees ? 1 : 0, "row \(row), column \(column)")
            }
        }
        let earlier = tree.treeMask(nodes: 6, seesEarlierNodes: true)
        XCTAssertEqual(earlier, (0..<36).map { $0 % 6 <= $0 / 6 ? 1 : 0 })
    }
}
