import XCTest
import ProtoWire

final class FieldIterationTests: XCTestCase {
    private func allFields(_ bytes: [UInt8]) throws -> [ProtoField] {
        var fields: [ProtoField] = []
        try ProtoBuffer(bytes).forEachField { fields.append($0) }
        return fields
    }

    func testYieldsEveryWireTypeWithOffsets() throws {
        let varint = WireBytes.varintField(1, 150)
        let fixed64 = WireBytes.fixed64Field(2, 7)
        let text = WireBytes.stringField(3, "hi")
        let fixed32 = WireBytes.fixed32Field(4, 9)
        let fields = try allFields(varint + fixed64 + text + fixed32)

        XCTAssertEqual(fields.map(\.fieldNumber), [1, 2, 3, 4])
        XCTAssertEqual(fields.map(\.wireType), [.varint, .fixed64, .lengthDelimited, .fixed32])
        XCTAssertEqual(fields.map(\.offset), [0, varint.count, varint.count + fixed64.count,
                                              varint.count + fixed64.count + text.count])
        XCTAssertEqual(try fields[0].uint64(), 150)
        XCTAssertEqual(try fields[1].fixed64(), 7)
        XCTAssertEqual(try fields[2].string(), "hi")
        XCTAssertEqual(try fields[3].fixed32(), 9)
    }

    func testLargeFieldNumbersAndMaximumFieldNumber() throws {
        let maxNumber = Int(ProtoReader.maximumFieldNumber)
        let fields = try allFields(WireBytes.varintField(3000, 1) + WireBytes.varintField(maxNumber, 2))
        XCTAssertEqual(fields.map(\.fieldNumber), [3000, maxNumber])
    }

    func testNestedMessageKeepsAbsoluteOffsets() throws {
        let inner = WireBytes.varintField(1, 5) + WireBytes.stringField(2, "x")
        let outer = WireBytes.varintField(7, 1) + WireBytes.lengthDelimitedField(9, inner)
        let fields = try allFields(outer)
        let nested = try fields[1].message()
        XCTAssertEqual(nested.range, 4..<(4 + inner.count))
        var innerFields: [ProtoField] = []
        try nested.forEachField { innerFields.append($0) }
        XCTAssertEqual(innerFields.map(\.offset), [4, 6])
        XCTAssertEqual(try innerFields[1].string(), "x")
    }

    func testPackedRepeatedVarintsAcceptPackedAndUnpackedForms() throws {
        let values: [UInt64] = [1, 300, 0, UInt64(bitPattern: -1)]
        let packed = try allFields(WireBytes.packedVarintField(1, values))
        XCTAssertEqual(try packed[0].packedVarints(), values)

        let unpacked = try allFields(values.flatMap { WireBytes.varintField(1, $0) })
        XCTAssertEqual(try unpacked.flatMap { try $0.packedVarints() }, values)

        let empty = try allFields(WireBytes.packedVarintField(1, []))
        XCTAssertEqual(try empty[0].packedVarints(), [])
    }

    func testPackedVarintsWithTruncatedElementThrows() throws {
        // Length 2 claims the payload [0x96, 0x81]: the second byte still continues.
        let fields = try allFields([0x0A, 0x02, 0x96, 0x81])
        XCTAssertThrowsError(try fields[0].packedVarints()) { error in
            XCTAssertEqual(error as? ProtoWireError, .truncatedVarint(offset: 2))
        }
    }

    func testWireTypeMismatchIsTypedError() throws {
        let fields = try allFields(WireBytes.varintField(5, 1))
        XCTAssertThrowsError(try fields[0].string()) { error in
            XCTAssertEqual(error as? ProtoWireError,
                           .unexpectedWireType(offset: 0, fieldNumber: 5, expected: .lengthDelimited, actual: .varint))
        }
        XCTAssertThrowsError(try fields[0].fixed32())
        XCTAssertThrowsError(try fields[0].double())
    }

    func testInvalidUTF8IsRejected() throws {
        let fields = try allFields(WireBytes.lengthDelimitedField(2, [0x61, 0xFF, 0x62]))
        XCTAssertThrowsError(try fields[0].string()) { error in
            XCTAssertEqual(error as? ProtoWireError, .invalidUTF8(offset: 2, fieldNumber: 2))
        }
        XCTAssertEqual(try fields[0].bytes(), [0x61, 0xFF, 0x62])
    }

    func testMultiByteUTF8Decodes() throws {
        let fields = try allFields(WireBytes.stringField(1, "κλειδί→🔑"))
        XCTAssertEqual(try fields[0].string(), "κλειδί→🔑")
    }

    func testSkipValueAdvancesPastEveryWireType() throws {
        let bytes = WireBytes.varintField(1, 300) + WireBytes.fixed64Field(2, 1) + WireBytes.stringField(3, "abc")
            + WireBytes.fixed32Field(4, 1) + WireBytes.groupField(5, WireBytes.varintField(1, 1))
            + WireBytes.varintField(6, 42)
        var reader = ProtoReader(bytes)
        for _ in 1...5 {
            let (number, wireType, offset) = try reader.readTag()
            try reader.skipValue(wireType: wireType, fieldNumber: number, tagOffset: offset)
        }
        XCTAssertEqual(try XCTUnwrap(reader.next()).uint64(), 42)
        XCTAssertTrue(reader.isAtEnd)
    }
}
