import XCTest
import ProtoWire

final class GroupTests: XCTestCase {
    func testGroupIsYieldedWithItsBodyAndIterationContinues() throws {
        let body = WireBytes.varintField(1, 7) + WireBytes.groupField(2, WireBytes.stringField(3, "deep"))
        let bytes = WireBytes.groupField(4, body) + WireBytes.varintField(5, 9)
        var reader = ProtoReader(bytes)
        let group = try XCTUnwrap(reader.next())
        XCTAssertEqual(group.wireType, .startGroup)
        XCTAssertEqual(group.payload, .group(ProtoBuffer(body)))
        XCTAssertEqual(try XCTUnwrap(reader.next()).uint64(), 9)
        XCTAssertNil(try reader.next())
    }

    func testEmptyGroup() throws {
        var reader = ProtoReader(WireBytes.groupField(1, []))
        let group = try XCTUnwrap(reader.next())
        XCTAssertEqual(group.payload, .group(ProtoBuffer([])))
    }

    func testUnterminatedGroupThrows() {
        var reader = ProtoReader(WireBytes.varintField(1, 1) + WireBytes.tag(2, 3) + WireBytes.varintField(1, 1))
        XCTAssertNoThrow(try reader.next())
        XCTAssertThrowsError(try reader.next()) { error in
            XCTAssertEqual(error as? ProtoWireError, .unterminatedGroup(offset: 2, fieldNumber: 2))
        }
    }

    func testStrayEndGroupThrows() {
        var reader = ProtoReader(WireBytes.tag(3, 4))
        XCTAssertThrowsError(try reader.next()) { error in
            XCTAssertEqual(error as? ProtoWireError, .unexpectedEndGroup(offset: 0, fieldNumber: 3))
        }
    }

    func testMismatchedEndGroupThrows() {
        var reader = ProtoReader(WireBytes.tag(1, 3) + WireBytes.tag(2, 4))
        XCTAssertThrowsError(try reader.next()) { error in
            XCTAssertEqual(error as? ProtoWireError, .unexpectedEndGroup(offset: 1, fieldNumber: 2))
        }
    }

    func testNestingBeyondLimitThrowsInsteadOfRecursing() {
        let depth = ProtoReader.maximumGroupDepth + 1
        let bytes = Array(repeating: WireBytes.tag(1, 3), count: depth).flatMap { $0 }
            + Array(repeating: WireBytes.tag(1, 4), count: depth).flatMap { $0 }
        var reader = ProtoReader(bytes)
        XCTAssertThrowsError(try reader.next()) { error in
            XCTAssertEqual(error as? ProtoWireError, .groupNestingTooDeep(offset: ProtoReader.maximumGroupDepth))
        }
    }

    func testNestingAtLimitIsAccepted() throws {
        let depth = ProtoReader.maximumGroupDepth
        let bytes = Array(repeating: WireBytes.tag(1, 3), count: depth).flatMap { $0 }
            + Array(repeating: WireBytes.tag(1, 4), count: depth).flatMap { $0 }
        var reader = ProtoReader(bytes)
        XCTAssertEqual(try reader.next()?.wireType, .startGroup)
        XCTAssertNil(try reader.next())
    }
}
