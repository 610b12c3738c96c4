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
}
