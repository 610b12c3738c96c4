/// The bundle's fixed names, one place for every Swift module: the export directory's files and
/// the key under which each package embeds metadata.json. Each is its namesake in
/// python/museflash/bundle.py, which types the contract for both languages; MetadataExamplesTests
/// compares them with the Python side's. What varies between bundles (functions, states, the
/// size below which no weight is compressed, ...) is in metadata.json, never here.
public enum BundleContract {
    /// The bundle's description, at the top of the export directory (`METADATA_FILE`).
    public static let metadataFileName = "metadata.json"
    /// The user-defined metadata entry of every package holding metadata.json's text
    /// (`EMBEDDED_METADATA_KEY`).
    public static let embeddedMetadataKey = "museflash.metadata"
    /// The Hugging Face tokenizer; `tokenizer.files` lists it first (`TOKENIZER_FILE`).
    public static let tokenizerFileName = "tokenizer.json"
    public static let tokenizerConfigFileName = "tokenizer_config.json"
    public static let specialTokensMapFileName = "special_tokens_map.json"
    /// A chat template kept in a file of its own (else `chat_template` in tokenizer_config.json).
    public static let chatTemplateFileName = "chat_template.jinja"
    /// The tokenizer files the exporter copies when the checkpoint has them, in the order
    /// `tokenizer.files` lists them (`TOKENIZER_FILES`).
    public static let tokenizerFileNames = [tokenizerFileName, tokenizerConfigFileName, specialTokensMapFileName,
                                             chatTemplateFileName]
}
