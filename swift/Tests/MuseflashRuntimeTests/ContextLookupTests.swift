import MuseflashRuntime
import XCTest

/// The copy rule on hand-made contexts (the goldens check it against Python on seeded ones).
final class ContextLookupTests: XCTestCase {
    func testALoopRepeatsWithItsPeriod() {
        XCTAssertEqual(ContextLookup.proposal([9, 1, 2, 3, 1, 2, 3, 1, 2], count: 7, minMatch: 2), [3, 1, 2, 3, 1, 2, 3])
    }

    func testTheLongestMatchWinsThenTheLatest() {
        // "4 5 6" occurred before (three tokens) and "5 6" more recently (two): the longer wins.
        XCTAssertEqual(ContextLookup.proposal([4, 5, 6, 7, 0, 5, 6, 8, 4, 5, 6], count: 1, minMatch: 2), [7])
        XCTAssertEqual(ContextLookup.proposal([5, 6, 1, 5, 6, 2, 5, 6], count: 1, minMatch: 2), [2])
    }

    func testNoProposalWithoutAMatchOfMinMatchTokens() {
        XCTAssertNil(ContextLookup.proposal([1, 2, 3, 4], count: 3, minMatch: 1))
        XCTAssertNil(ContextLookup.proposal([1, 2, 3, 9, 2, 3], count: 3, minMatch: 3))
        XCTAssertEqual(ContextLookup.proposal([1, 2, 3, 9, 2, 3], count: 3, minMatch: 2), [9, 2, 3])
        XCTAssertNil(ContextLookup.proposal([7], count: 2, minMatch: 1))
    }

    func testOccurrencesOlderThanTheWindowAreNotLookedAt() {
        let filler = (0..<ContextLookup.window).map { Int32(10 + $0) }
        XCTAssertEqual(ContextLookup.proposal([1, 2, 3, 4] + filler.dropLast(5) + [1, 2, 3], count: 1, minMatch: 3), [4])
        XCTAssertNil(ContextLookup.proposal([1, 2, 3, 4] + filler + [1, 2, 3], count: 1, minMatch: 3))
    }
}
