/// A property body throws this to say the property does not hold.
struct Violation: Error {
    var detail: String
}

/// Collects every problem a property finds, so one run names them all
/// instead of stopping at the first.
struct Problems {
    private(set) var messages: [String] = []

    mutating func add(_ message: String) {
        messages.append(message)
    }

    mutating func require(_ condition: Bool, _ message: @autoclosure () -> String) {
        if !condition { messages.append(message()) }
    }

    /// Throws the collected problems, or returns `success` as the detail.
    func verdict(_ success: String) throws -> String {
        guard messages.isEmpty else { throw Violation(detail: messages.joined(separator: "; ")) }
        return success
    }
}

func evaluate(_ name: String, _ body: () throws -> String) -> PropertyResult {
    do {
        return PropertyResult(name: name, holds: true, detail: try body())
    } catch let violation as Violation {
        return PropertyResult(name: name, holds: false, detail: violation.detail)
    } catch {
        return PropertyResult(name: name, holds: false, detail: String(describing: error))
    }
}
