import XCTest
@testable import MuseflashTokenizer

/// The streaming decoder holds back the start of a character split across tokens and never
/// shows a replacement character that a later token completes.
final class StreamingDecoderTests: XCTestCase {
    private func tokenizer() throws -> Tokenizer {
        // "é" is C3 A9, "😀" F0 9F 98 80; one merge joins the last two bytes of the emoji.
        try SyntheticTokenizers.load(SyntheticTokenizers.byteLevel(merges: [([0x98], [0x80]), ([0x61], [0xC3])]))
    }

    private func id(_ tokenizer: Tokenizer, _ bytes: [UInt8]) -> Int32 {
        tokenizer.id(for: SyntheticTokenizers.spell(bytes))!
    }

    func testTwoByteCharacterSplitAcrossTokens() throws {
        let tokenizer = try tokenizer()
        var stream = tokenizer.streamingDecoder()
        XCTAssertEqual(stream.push(id(tokenizer, [0xC3])), "")
        XCTAssertEqual(stream.heldBackByteCount, 1)
        XCTAssertEqual(stream.push(id(tokenizer, [0xA9])), "é")
        XCTAssertEqual(stream.heldBackByteCount, 0)
        XCTAssertEqual(stream.finish(), "")
    }

    func testFourByteCharacterOverThreeTokens() throws {
        let tokenizer = try tokenizer()
        var stream = tokenizer.streamingDecoder()
        XCTAssertEqual(stream.push(id(tokenizer, [0xF0])), "")
        XCTAssertEqual(stream.push(id(tokenizer, [0x9F])), "")
        XCTAssertEqual(stream.heldBackByteCount, 2)
        XCTAssertEqual(stream.push(id(tokenizer, [0x98, 0x80])), "😀")
    }

    func testTextBeforeAnIncompleteCharacterIsShown() throws {
        let tokenizer = try tokenizer()
        var stream = tokenizer.streamingDecoder()
        XCTAssertEqual(stream.push(id(tokenizer, [0x61, 0xC3])), "a")
        XCTAssertEqual(stream.heldBackByteCount, 1)
        XCTAssertEqual(stream.push(id(tokenizer, [0xA9])), "é")
    }

    func testBytesThatCanNeverCompleteAreReplacedAtOnce() throws {
        let tokenizer = try tokenizer()
        var stream = tokenizer.streamingDecoder()
        XCTAssertEqual(stream.push(id(tokenizer, [0xFF])), "\u{FFFD}")
        XCTAssertEqual(stream.push(id(tokenizer, [0xC3])), "")
        XCTAssertEqual(stream.push(id(tokenizer, [0x41])), "\u{FFFD}A")
        XCTAssertEqual(stream.push(id(tokenizer, [0xE0])), "")
        XCTAssertEqual(stream.push(id(tokenizer, [0x80])), "\u{FFFD}\u{FFFD}")  // E0 needs A0...BF next
    }

    func testFinishReplacesWhatIsStillHeldBack() throws {
        let tokenizer = try tokenizer()
        var stream = tokenizer.streamingDecoder()
        XCTAssertEqual(stream.push([id(tokenizer, [0x61]), id(tokenizer, [0xF0]), id(tokenizer, [0x9F])]), "a")
        XCTAssertEqual(stream.finish(), "\u{FFFD}")
        XCTAssertEqual(stream.heldBackByteCount, 0)
    }

    func testSkippedSpecialTokenInsideASplitCharacter() throws {
        let tokenizer = try tokenizer()
        let special = tokenizer.id(for: "</s>")!
        let ids = [id(tokenizer, [0xC3]), special, id(tokenizer, [0xA9])]
        var skipping = tokenizer.streamingDecoder(skipSpecialTokens: true)
        XCTAssertEqual(ids.map { skipping.push($0) }.joined() + skipping.finish(), "é")
        XCTAssertEqual(tokenizer.decode(ids, skipSpecialTokens: true), "é")
        var keeping = tokenizer.streamingDecoder()
        XCTAssertEqual(ids.map { keeping.push($0) }.joined() + keeping.finish(), "\u{FFFD}</s>\u{FFFD}")
        XCTAssertEqual(tokenizer.decode(ids), "\u{FFFD}</s>\u{FFFD}")
    }

    /// Random byte strings cut into random tokens: what the stream has shown is always a prefix
    /// of the whole decode, it shows no replacement character the whole decode does not have at
    /// that place, and everything together equals the decode.
    func testRandomSplitsAgreeWithWholeDecode() throws {
        let tokenizer = try tokenizer()
        var random = SplitMix64(state: 23)
        let pieces: [[UInt8]] = [[0x61], [0xC3], [0xA9], [0xF0], [0x9F], [0x98, 0x80], [0xE2], [0x82], [0xAC], [0xFF], [0x80],
                                 [0xED], [0xA0], [0x20]]
        for _ in 0..<2000 {
            let ids = (0..<random.below(12)).map { _ in id(tokenizer, pieces[random.below(pieces.count)]) }
            let whole = tokenizer.decode(ids)
            var stream = tokenizer.streamingDecoder()
            var shown = ""
            for id in ids {
                shown += stream.push(id)
                XCTAssertTrue(whole.hasPrefix(shown), "\(ids): \(shown.debugDescription) is not a prefix of \(whole.debugDescription)")
            }
            shown += stream.finish()
            XCTAssertEqual(shown, whole, "\(ids)")
        }
    }

    /// Valid UTF-8 text encoded and streamed back one id at a time never shows U+FFFD.
    func testValidTextNeverShowsAReplacementCharacter() throws {
        let tokenizer = try tokenizer()
        let text = "aé 😀 €uro, 日本語 a\u{301}"
        var stream = tokenizer.streamingDecoder()
        var shown = ""
        for id in tokenizer.encode(text) {
            let piece = stream.push(id)
            XCTAssertFalse(piece.unicodeScalars.contains("\u{FFFD}"))
            shown += piece
        }
        XCTAssertEqual(shown + stream.finish(), text)
    }

    func testWordLevelJoinsWithSpaces() throws {
        let tokenizer = try SyntheticTokenizers.load(SyntheticTokenizers.wordLevel())
        XCTAssertEqual(tokenizer.encode("hello world<mask> unknown"), [1, 2, 3, 0])
        var stream = tokenizer.streamingDecoder()
        XCTAssertEqual(stream.push(1), "hello")
        XCTAssertEqual(stream.push(2), " world")
        XCTAssertEqual(stream.push(99), "")  // no such id: left out, as decode leaves it out
        XCTAssertEqual(tokenizer.decode([1, 2, 99, 3]), "hello world <mask>")
        XCTAssertEqual(tokenizer.decode([1, 3, 2], skipSpecialTokens: true), "hello world")
    }
}
