import Foundation

/// The normalizers museflash's tokenizers use: none, or Unicode NFC (Qwen2's layout).
enum Normalizer: Equatable {
    case none
    case nfc

    /// `bytes[range]` (valid UTF-8) normalized, or nil when normalizing leaves it as it is.
    /// ASCII text is its own NFC, so only text with other scalars is looked at.
    func apply(_ bytes: UnsafeBufferPointer<UInt8>, _ range: Range<Int>) -> [UInt8]? {
        guard self == .nfc, range.contains(where: { bytes[$0] >= 0x80 }) else { return nil }
        let text = String(decoding: UnsafeBufferPointer(rebasing: bytes[range]), as: UTF8.self)
        let normalized = Array(text.precomposedStringWithCanonicalMapping.utf8)
        return normalized.elementsEqual(bytes[range]) ? nil : normalized
    }
}
