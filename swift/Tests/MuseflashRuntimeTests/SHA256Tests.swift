@testable import MuseflashRuntime
import XCTest

/// The compiled-model cache's SHA-256 against FIPS 180-4's examples.
final class SHA256Tests: XCTestCase {
    func digest(_ bytes: [UInt8], chunk: Int? = nil) -> String {
        var hash = SHA256()
        if let chunk = chunk {
            for start in stride(from: 0, to: bytes.count, by: chunk) { hash.update(bytes[start..<min(start + chunk, bytes.count)]) }
        } else {
            hash.update(bytes)
        }
        return hash.hex()
    }

    func testKnownDigests() {
        XCTAssertEqual(digest([]), "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855")
        XCTAssertEqual(digest(Array("abc".utf8)), "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad")
        let two = Array("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq".utf8)
        XCTAssertEqual(digest(two), "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1")
    }

    func testChunkedUpdatesGiveTheSameDigest() {
        let million = [UInt8](repeating: UInt8(ascii: "a"), count: 1_000_000)
        let whole = "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0"
        XCTAssertEqual(digest(million), whole)
        XCTAssertEqual(digest(million, chunk: 4099), whole)
        XCTAssertEqual(digest(million, chunk: 64), whole)
    }
}
