/// The one reader of the Swift tools' command lines (swift-generate, swift-tokenize,
/// check-contract): `--flag value` and `--flag=value` spell the same, as in the Python tools'
/// absl flags; a flag that takes no value refuses one given with `=`; a missing value is named.
///
///     var flags = CommandLineFlags(arguments, suffix: " (see --help)")
///     while let flag = try flags.next() {
///         switch flag {
///         case "--export-dir": directory = try flags.value(of: flag)
///         case "--no-draft": useDrafter = false
///         default: throw ...  // `flag` is the unknown argument as typed, before any `=`
///         }
///     }
public struct CommandLineFlags {
    /// A command line that cannot be read: one line, ending in the tool's `suffix`.
    public struct Failure: Error, CustomStringConvertible, Equatable {
        public var description: String
    }

    private var rest: ArraySlice<String>
    /// The value written after `=` of the flag `next()` just returned, until it is taken.
    private var inline: (flag: String, value: String)?
    private let suffix: String

    /// `suffix` ends every error message, e.g. " (see --help)".
    public init(_ arguments: [String], suffix: String = "") {
        rest = arguments[...]
        self.suffix = suffix
    }

    /// The next flag or stray argument, nil after the last. `--flag=value` gives `--flag`, and
    /// `value(of:)` then returns `value`; a flag whose `=value` was not taken is refused here.
    public mutating func next() throws -> String? {
        if let inline {
            throw failure("\(inline.flag) takes no value, got \"\(inline.value)\"")
        }
        guard let argument = rest.popFirst() else { return nil }
        if argument.hasPrefix("--"), let equals = argument.firstIndex(of: "=") {
            let flag = String(argument[..<equals])
            inline = (flag, String(argument[argument.index(after: equals)...]))
            return flag
        }
        return argument
    }

    /// The value of `flag`, which `next()` just returned: what followed its `=`, else the next
    /// argument whatever it looks like (so `--prompt --x` prompts with "--x").
    public mutating func value(of flag: String) throws -> String {
        if let inline {
            self.inline = nil
            return inline.value
        }
        guard let value = rest.popFirst() else { throw failure("\(flag) needs a value") }
        return value
    }

    /// The values of a flag that takes a list: what followed its `=`, then every argument up to
    /// the next one that starts with `--`.
    public mutating func values(of flag: String) -> [String] {
        var values: [String] = []
        if let inline {
            self.inline = nil
            values.append(inline.value)
        }
        while let next = rest.first, !next.hasPrefix("--") {
            values.append(next)
            rest.removeFirst()
        }
        return values
    }

    /// The value of `flag` as a whole number.
    public mutating func integer(of flag: String) throws -> Int {
        let text = try value(of: flag)
        guard let number = Int(text) else { throw failure("\(flag) takes a whole number, got \"\(text)\"") }
        return number
    }

    /// The value of `flag` as a finite number.
    public mutating func number(of flag: String) throws -> Double {
        let text = try value(of: flag)
        guard let number = Double(text), number.isFinite else {
            throw failure("\(flag) takes a number, got \"\(text)\"")
        }
        return number
    }

    /// A failure worded like this reader's own: `message` and the tool's suffix.
    public func failure(_ message: String) -> Failure {
        Failure(description: message + suffix)
    }
}
