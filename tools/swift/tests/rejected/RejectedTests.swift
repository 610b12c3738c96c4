import Foundation
import XCTest

// Tests discovery must refuse to skip silently; only its symbol graph is built (see BUILD.bazel).
final class RejectedTests: XCTestCase {
    func testRunnable() {}

    private func testPrivate() {}
}

/// Its superclass is in another module, so discovery cannot tell whether it is an XCTestCase.
class ForeignSubclass: NSObject {
    func testOnForeignSubclass() {}
}
