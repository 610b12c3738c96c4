import XCTest

// Fixture for //tools/swift:xctest_discovery: every method that XCTest would run on Apple
// platforms, written the ways a text scan misses. discovery_test.sh checks that exactly the
// methods in expected_tests.txt ran, so a test that is not discovered fails that test.

class DiscoveryBaseCase: XCTestCase {
    func testInheritedByEverySubclass() {}

    /// Not a test: takes an argument.
    func testWithArgument(_ value: Int) { XCTFail("run with \(value)") }
}

final class DiscoveryFixtureTests: DiscoveryBaseCase {
    func testInClassBody() throws {}

    /// Not tests: static, or returning a value.
    static func testStatic() { XCTFail("static methods are not tests") }
    func testReturningValue() -> Int { XCTFail("methods returning a value are not tests"); return 0 }
}

extension DiscoveryFixtureTests {
    func testInExtension() {}

    func testAsyncInExtension() async throws {
        await Task.yield()
    }

    @inline(never)  // attributes and line breaks do not hide a test
    func
        testSpreadOverLines
        (
        )
        throws
    {}
}

enum DiscoveryNamespace {
    final class NestedTests: XCTestCase {
        func testInNestedClass() -> Void {}
    }
}

/// Not a test case, so its test-named method is not a test.
final class NotATestCase {
    func testNothing() {}
}
