import XCTest

// A test declared in an extension in a file of its own, away from its class.
extension DiscoveryFixtureTests {
    func testInExtensionInAnotherFile() {}
}
