import XCTest
import ProtoWire

final class FixedWidthTests: XCTestCase {
    func testFixed32IsLittleEndian() throws {
        var reader = ProtoReader([0x78, 0x56, 0x34, 0x12])
        XCTAssertEqual(try reader.readFixed32(), 0x1234_5678)
        XCTAssertTrue(reader.isAtEnd)
    }

    func testFixed64IsLittleEndian() throws {
        var reader = ProtoReader([0xEF, 0xCD, 0xAB, 0x89, 0x67, 0x45, 0x23, 0x01])
        XCTAssertEqual(try reader.readFixed64(), 0x0123_4567_89AB_CDEF)
    }

    func testFloatAndDoubleFields() throws {
        let bytes = WireBytes.fixed32Field(1, Float(1.5).bitPattern) + WireBytes.fixed64Field(2, (-0.25).bitPattern)
        var reader = ProtoReader(bytes)
        XCTAssertEqual(try XCTUnwrap(reader.next()).float(), 1.5)
        XCTAssertEqual(try XCTUnwrap(reader.next()).double(), -0.25)
        XCTAssertNil(try reader.next())
    }

    func testTruncatedFixed32ReportsNeededAndAvailable() {
        var reader = ProtoReader([0x0D, 0x01, 0x02])
        XCTAssertThrowsError(try reader.next()) { error in
            XCTAssertEqual(error as? ProtoWireError, .truncated(offset: 1, needed: 4, available: 2))
        }
    }

    func testTruncatedFixed64ReportsNeededAndAvailable() {
        var reader = ProtoReader([0x09, 0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07])
        XCTAssertThrowsError(try reader.next()) { error in
            XCTAssertEqual(error as? ProtoWireError, .truncated(offset: 1, needed: 8, available: 7))
        }
    }
}
