import XCTest
import ProtoWire
import TestSupport

final class VarintTests: XCTestCase {
    private func decodeVarint(_ bytes: [UInt8]) throws -> (value: UInt64, consumed: Int) {
        var reader = ProtoReader(bytes)
        let value = try reader.readVarint()
        return (value, reader.offset)
    }

    func testDecodesKnownEncodings() throws {
        let cases: [([UInt8], UInt64)] = [
            ([0x00], 0),
            ([0x01], 1),
            ([0x7F], 127),
            ([0x80, 0x01], 128),
            ([0xAC, 0x02], 300),
            ([0xFF, 0xFF, 0xFF, 0xFF, 0x0F], UInt64(UInt32.max)),
            ([0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0x01], UInt64.max),
        ]
        for (bytes, expected) in cases {
            let decoded = try decodeVarint(bytes)
            XCTAssertEqual(decoded.value, expected, "bytes \(bytes)")
            XCTAssertEqual(decoded.consumed, bytes.count, "bytes \(bytes)")
        }
    }

    func testRoundTripsTestEncoderAcrossBitWidths() throws {
        var generator = FuzzGenerator(seed: 42)
        for bits in 0...64 {
            let value: UInt64 = bits == 0 ? 0 : (UInt64.random(in: 0...UInt64.max, using: &generator) >> (64 - bits)) | (1 << (bits - 1))
            let bytes = WireBytes.varint(value)
            XCTAssertEqual(try decodeVarint(bytes).value, value)
        }
    }

    func testAcceptsRedundantContinuationBytes() throws {
        // Non-minimal encodings are legal protobuf and must decode to the same value.
        XCTAssertEqual(try decodeVarint([0x81, 0x80, 0x80, 0x00]).value, 1)
    }

    func testTruncatedVarintReportsStartOffset() {
        var reader = ProtoReader([0x08, 0x96, 0x81])
        XCTAssertNoThrow(try reader.readTag())
        XCTAssertThrowsError(try reader.readVarint()) { error in
            XCTAssertEqual(error as? ProtoWireError, .truncatedVarint(offset: 1))
        }
    }

    func testEmptyInputIsTruncatedVarint() {
        var reader = ProtoReader([])
        XCTAssertThrowsError(try reader.readVarint()) { error in
            XCTAssertEqual(error as? ProtoWireError, .truncatedVarint(offset: 0))
        }
    }

    func testTenthByteBeyondBit63Overflows() {
        let bytes: [UInt8] = [0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0x02]
        XCTAssertThrowsError(try decodeVarint(bytes)) { error in
            XCTAssertEqual(error as? ProtoWireError, .varintOverflow(offset: 0))
        }
    }

    func testElevenByteVarintOverflows() {
        let bytes = [UInt8](repeating: 0x80, count: 10) + [0x00]
        XCTAssertThrowsError(try decodeVarint(bytes)) { error in
            XCTAssertEqual(error as? ProtoWireError, .varintOverflow(offset: 0))
        }
    }

    func testZigZagDecoding() {
        XCTAssertEqual(ZigZag.decode32(0), 0)
        XCTAssertEqual(ZigZag.decode32(1), -1)
        XCTAssertEqual(ZigZag.decode32(2), 1)
        XCTAssertEqual(ZigZag.decode32(4_294_967_294), Int32.max)
        XCTAssertEqual(ZigZag.decode32(4_294_967_295), Int32.min)
        XCTAssertEqual(ZigZag.decode64(3), -2)
        XCTAssertEqual(ZigZag.decode64(UInt64.max - 1), Int64.max)
        XCTAssertEqual(ZigZag.decode64(UInt64.max), Int64.min)
    }

    func testSignedAccessorsFollowProtobufSemantics() throws {
        // int32 -1 is written sign-extended to 10 bytes by every encoder.
        let negativeOne = WireBytes.varintField(1, UInt64(bitPattern: -1))
        XCTAssertEqual(negativeOne.count, 11)
        var reader = ProtoReader(negativeOne)
        let field = try XCTUnwrap(reader.next())
        XCTAssertEqual(try field.int32(), -1)
        XCTAssertEqual(try field.int64(), -1)
        XCTAssertEqual(try field.uint32(), UInt32.max)

        var zigzag = ProtoReader(WireBytes.varintField(2, 5))
        let sint = try XCTUnwrap(zigzag.next())
        XCTAssertEqual(try sint.sint32(), -3)
        XCTAssertEqual(try sint.sint64(), -3)
        XCTAssertTrue(try sint.bool())
    }
}
