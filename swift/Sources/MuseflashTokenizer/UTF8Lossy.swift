/// UTF-8 decoding that replaces each maximal ill-formed subpart with U+FFFD, as Rust's
/// `String::from_utf8_lossy` does (Unicode's "substitution of maximal subparts"), and that can
/// stop before a trailing sequence that is incomplete but could still be completed.
enum UTF8Lossy {
    private static let replacement: [UInt8] = [0xEF, 0xBF, 0xBD]

    /// The range the byte after `lead` must fall in, and how many continuation bytes `lead` needs;
    /// nil when `lead` cannot start a character.
    @inline(__always)
    private static func shape(of lead: UInt8) -> (second: ClosedRange<UInt8>, count: Int)? {
        switch lead {
        case 0xC2...0xDF: return (0x80...0xBF, 1)
        case 0xE0: return (0xA0...0xBF, 2)
        case 0xE1...0xEC, 0xEE...0xEF: return (0x80...0xBF, 2)
        case 0xED: return (0x80...0x9F, 2)
        case 0xF0: return (0x90...0xBF, 3)
        case 0xF1...0xF3: return (0x80...0xBF, 3)
        case 0xF4: return (0x80...0x8F, 3)
        default: return nil
        }
    }

    /// Decodes `bytes`, appending well-formed UTF-8 to `output`. With `final` false, a trailing
    /// incomplete sequence is left undecoded; returns how many bytes were consumed.
    static func decode(_ bytes: UnsafeBufferPointer<UInt8>, final: Bool, into output: inout [UInt8]) -> Int {
        let count = bytes.count
        var index = 0
        while index < count {
            let lead = bytes[index]
            if lead < 0x80 {
                output.append(lead)
                index += 1
                continue
            }
            guard let (second, needed) = shape(of: lead) else {
                output.append(contentsOf: replacement)
                index += 1
                continue
            }
            // How many of the needed continuation bytes are present and valid.
            var valid = 0
            while valid < needed, index + 1 + valid < count {
                let byte = bytes[index + 1 + valid]
                let allowed = valid == 0 ? second : 0x80...0xBF
                guard allowed.contains(byte) else { break }
                valid += 1
            }
            if valid == needed {
                output.append(contentsOf: bytes[index...(index + needed)])
                index += needed + 1
            } else if index + 1 + valid == count && !final {
                return index  // could still be completed by later bytes
            } else {
                output.append(contentsOf: replacement)
                index += 1 + valid
            }
        }
        return count
    }

    /// The whole of `bytes` as a String, ill-formed parts replaced.
    static func string(_ bytes: [UInt8]) -> String {
        var output: [UInt8] = []
        output.reserveCapacity(bytes.count)
        _ = bytes.withUnsafeBufferPointer { decode($0, final: true, into: &output) }
        return String(decoding: output, as: UTF8.self)
    }
}
