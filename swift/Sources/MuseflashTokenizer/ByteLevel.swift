/// GPT-2's reversible map between bytes and printable Unicode scalars: the printable Latin-1
/// bytes stand for themselves, the other 68 become U+0100 onwards in byte order.
enum ByteLevel {
    /// byte -> the scalar that spells it in the vocabulary.
    static let scalarForByte: [Unicode.Scalar] = {
        var printable = [Bool](repeating: false, count: 256)
        for range in [0x21...0x7E, 0xA1...0xAC, 0xAE...0xFF] {
            for byte in range { printable[byte] = true }
        }
        var next: UInt32 = 256
        return (0..<256).map { byte in
            if printable[byte] { return Unicode.Scalar(UInt8(byte)) }
            defer { next += 1 }
            return Unicode.Scalar(next)!
        }
    }()

    /// scalar value -> byte, for the 256 scalars above.
    static let byteForScalar: [UInt32: UInt8] = {
        var map: [UInt32: UInt8] = [:]
        for (byte, scalar) in scalarForByte.enumerated() { map[scalar.value] = UInt8(byte) }
        return map
    }()

    /// The vocabulary spelling of `bytes`.
    static func spell<S: Sequence>(_ bytes: S) -> String where S.Element == UInt8 {
        var view = String.UnicodeScalarView()
        for byte in bytes { view.append(scalarForByte[Int(byte)]) }
        return String(view)
    }

    /// The bytes a token stands for: its scalars mapped back when every one is in the map,
    /// otherwise its own UTF-8 (as the ByteLevel decoder of the tokenizers library does).
    static func bytes(ofToken token: String) -> [UInt8] {
        var bytes: [UInt8] = []
        for scalar in token.unicodeScalars {
            guard let byte = byteForScalar[scalar.value] else { return Array(token.utf8) }
            bytes.append(byte)
        }
        return bytes
    }
}
