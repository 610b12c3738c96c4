import XCTest
import ProtoWire
import TestSupport

final class MalformedInputTests: XCTestCase {
    /// Walks every field and, like a schema-less consumer, tries nested
    /// messages too; any error must be a ProtoWireError inside the buffer.
    private func exhaustivelyDecode(_ buffer: ProtoBuffer, depth: Int = 0) throws {
        try buffer.forEachField { field in
            _ = try? field.packedVarints()
            _ = try? field.string()
            if depth < 8, case .lengthDelimited(let nested) = field.payload {
                try? exhaustivelyDecode(nested, depth: depth + 1)
            }
            if depth < 8, case .group(let nested) = field.payload {
                try? exhaustivelyDecode(nested, depth: depth + 1)
            }
        }
    }

    private func assertWireError(_ error: Error, within length: Int, file: StaticString = #filePath, line: UInt = #line) {
        guard let wireError = error as? ProtoWireError else {
            return XCTFail("unexpected error type \(error)", file: file, line: line)
        }
        XCTAssertLessThanOrEqual(wireError.offset, length, "\(wireError)", file: file, line: line)
        XCTAssertGreaterThanOrEqual(wireError.offset, 0, file: file, line: line)
    }

    func testUndefinedWireTypesThrow() {
        for wireType: UInt8 in [6, 7] {
            var reader = ProtoReader(WireBytes.tag(1, wireType) + [0])
            XCTAssertThrowsError(try reader.next()) { error in
                XCTAssertEqual(error as? ProtoWireError, .invalidWireType(offset: 0, rawValue: wireType))
            }
        }
    }

    func testFieldNumberZeroThrows() {
        var reader = ProtoReader([0x00, 0x01])
        XCTAssertThrowsError(try reader.next()) { error in
            XCTAssertEqual(error as? ProtoWireError, .invalidFieldNumber(offset: 0, fieldNumber: 0))
        }
    }

    func testFieldNumberAboveTwentyNineBitsThrows() {
        let tooLarge = ProtoReader.maximumFieldNumber + 1
        var reader = ProtoReader(WireBytes.varint(tooLarge << 3) + [0x00])
        XCTAssertThrowsError(try reader.next()) { error in
            XCTAssertEqual(error as? ProtoWireError, .invalidFieldNumber(offset: 0, fieldNumber: tooLarge))
        }
    }

    func testLengthBeyondBufferThrowsWithoutAllocating() {
        // A length near UInt64.max must be compared, never converted to Int.
        var reader = ProtoReader(WireBytes.tag(1, 2) + WireBytes.varint(UInt64.max) + [0x01])
        XCTAssertThrowsError(try reader.next()) { error in
            XCTAssertEqual(error as? ProtoWireError, .truncated(offset: 11, needed: UInt64.max, available: 1))
        }
    }

    func testEveryTruncationOfAMessageEitherDecodesAPrefixOrThrows() throws {
        let pieces: [[UInt8]] = [
            WireBytes.varintField(1, 300),
            WireBytes.fixed64Field(2, 0xDEAD_BEEF),
            WireBytes.stringField(3, "museflash"),
            WireBytes.fixed32Field(4, 17),
            WireBytes.groupField(5, WireBytes.varintField(1, 1) + WireBytes.stringField(2, "g")),
            WireBytes.packedVarintField(6, [1, 2, 300, 70000]),
            WireBytes.lengthDelimitedField(7, WireBytes.varintField(1, 9) + WireBytes.stringField(2, "nested")),
        ]
        let message = pieces.flatMap { $0 }
        var boundaries: [Int: Int] = [0: 0]
        var end = 0
        for (index, piece) in pieces.enumerated() {
            end += piece.count
            boundaries[end] = index + 1
        }

        for length in 0...message.count {
            var fieldCount = 0
            do {
                try ProtoBuffer(Array(message[0..<length])).forEachField { _ in fieldCount += 1 }
                XCTAssertEqual(boundaries[length], fieldCount, "prefix of \(length) bytes decoded but is not a field boundary")
            } catch {
                XCTAssertNil(boundaries[length], "prefix of \(length) bytes is a field boundary but threw \(error)")
                assertWireError(error, within: length)
            }
        }
    }

    func testRandomBytesNeverTrap() {
        var generator = FuzzGenerator(seed: 0x6D75_7365)
        for _ in 0..<3000 {
            let count = Int.random(in: 0...64, using: &generator)
            let bytes = (0..<count).map { _ in UInt8.random(in: 0...255, using: &generator) }
            do {
                try exhaustivelyDecode(ProtoBuffer(bytes))
            } catch {
                assertWireError(error, within: count)
            }
        }
    }

    func testMutatedValidMessagesNeverTrap() {
        let valid = WireBytes.lengthDelimitedField(1, WireBytes.stringField(1, "name")
            + WireBytes.lengthDelimitedField(3, WireBytes.lengthDelimitedField(5, WireBytes.packedVarintField(1, [1, 4, 4]))))
            + WireBytes.varintField(2, 9)
        var generator = FuzzGenerator(seed: 7)
        for _ in 0..<3000 {
            var bytes = valid
            for _ in 0..<Int.random(in: 1...3, using: &generator) {
                bytes[Int.random(in: 0..<bytes.count, using: &generator)] = UInt8.random(in: 0...255, using: &generator)
            }
            do {
                try exhaustivelyDecode(ProtoBuffer(bytes))
            } catch {
                assertWireError(error, within: bytes.count)
            }
        }
    }
}
