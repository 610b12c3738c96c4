/// Field numbers of the Core ML specification, taken from coremltools 9.0's
/// compiled descriptors (coremltools/proto/Model_pb2.py, FeatureTypes_pb2.py),
/// which mirror Model.proto and FeatureTypes.proto. Changing any of these
/// silently misreads every package, so each one names its message and field.
enum SpecFieldNumbers {
    enum Model {
        static let specificationVersion = 1   // Model.specificationVersion (int32)
        static let description = 2            // Model.description (ModelDescription)
        static let isUpdatable = 10           // Model.isUpdatable (bool)
        static let mlProgram = 502            // Model.mlProgram (MILSpec.Program)
    }

    /// Members of the `Model.Type` oneof; only their presence is recorded.
    static let modelTypeNames: [Int: String] = [
        200: "pipelineClassifier",            // Model.pipelineClassifier
        201: "pipelineRegressor",             // Model.pipelineRegressor
        202: "pipeline",                      // Model.pipeline
        300: "glmRegressor",                  // Model.glmRegressor
        301: "supportVectorRegressor",        // Model.supportVectorRegressor
        302: "treeEnsembleRegressor",         // Model.treeEnsembleRegressor
        303: "neuralNetworkRegressor",        // Model.neuralNetworkRegressor
        304: "bayesianProbitRegressor",       // Model.bayesianProbitRegressor
        400: "glmClassifier",                 // Model.glmClassifier
        401: "supportVectorClassifier",       // Model.supportVectorClassifier
        402: "treeEnsembleClassifier",        // Model.treeEnsembleClassifier
        403: "neuralNetworkClassifier",       // Model.neuralNetworkClassifier
        404: "kNearestNeighborsClassifier",   // Model.kNearestNeighborsClassifier
        500: "neuralNetwork",                 // Model.neuralNetwork
        501: "itemSimilarityRecommender",     // Model.itemSimilarityRecommender
        502: "mlProgram",                     // Model.mlProgram
        555: "customModel",                   // Model.customModel
        556: "linkedModel",                   // Model.linkedModel
        560: "classConfidenceThresholding",   // Model.classConfidenceThresholding
        600: "oneHotEncoder",                 // Model.oneHotEncoder
        601: "imputer",                       // Model.imputer
        602: "featureVectorizer",             // Model.featureVectorizer
        603: "dictVectorizer",                // Model.dictVectorizer
        604: "scaler",                        // Model.scaler
        606: "categoricalMapping",            // Model.categoricalMapping
        607: "normalizer",                    // Model.normalizer
        609: "arrayFeatureExtractor",         // Model.arrayFeatureExtractor
        610: "nonMaximumSuppression",         // Model.nonMaximumSuppression
        900: "identity",                      // Model.identity
        2000: "textClassifier",               // Model.textClassifier
        2001: "wordTagger",                   // Model.wordTagger
        2002: "visionFeaturePrint",           // Model.visionFeaturePrint
        2003: "soundAnalysisPreprocessing",   // Model.soundAnalysisPreprocessing
        2004: "gazetteer",                    // Model.gazetteer
        2005: "wordEmbedding",                // Model.wordEmbedding
        2006: "audioFeaturePrint",            // Model.audioFeaturePrint
        3000: "serializedModel",              // Model.serializedModel
    ]

    enum ModelDescription {
        static let input = 1                  // ModelDescription.input (repeated FeatureDescription)
        static let output = 10                // ModelDescription.output (repeated FeatureDescription)
        static let predictedFeatureName = 11  // ModelDescription.predictedFeatureName (string)
        static let predictedProbabilitiesName = 12 // ModelDescription.predictedProbabilitiesName (string)
        static let state = 13                 // ModelDescription.state (repeated FeatureDescription)
        static let functions = 20             // ModelDescription.functions (repeated FunctionDescription)
        static let defaultFunctionName = 21   // ModelDescription.defaultFunctionName (string)
        static let metadata = 100             // ModelDescription.metadata (Metadata)
    }

    enum FunctionDescription {
        static let name = 1                   // FunctionDescription.name (string)
        static let input = 2                  // FunctionDescription.input (repeated FeatureDescription)
        static let output = 3                 // FunctionDescription.output (repeated FeatureDescription)
        static let predictedFeatureName = 4   // FunctionDescription.predictedFeatureName (string)
        static let predictedProbabilitiesName = 5 // FunctionDescription.predictedProbabilitiesName (string)
        static let state = 6                  // FunctionDescription.state (repeated FeatureDescription)
    }

    enum Metadata {
        static let shortDescription = 1       // Metadata.shortDescription (string)
        static let versionString = 2          // Metadata.versionString (string)
        static let author = 3                 // Metadata.author (string)
        static let license = 4                // Metadata.license (string)
        static let userDefined = 100          // Metadata.userDefined (map<string, string>)
    }

    /// Protobuf encodes a map as repeated entry messages with these fields.
    enum MapEntry {
        static let key = 1                    // Metadata.UserDefinedEntry.key (string)
        static let value = 2                  // Metadata.UserDefinedEntry.value (string)
    }

    enum FeatureDescription {
        static let name = 1                   // FeatureDescription.name (string)
        static let shortDescription = 2       // FeatureDescription.shortDescription (string)
        static let type = 3                   // FeatureDescription.type (FeatureType)
    }

    enum FeatureType {
        static let int64Type = 1              // FeatureType.int64Type (Int64FeatureType)
        static let doubleType = 2             // FeatureType.doubleType (DoubleFeatureType)
        static let stringType = 3             // FeatureType.stringType (StringFeatureType)
        static let imageType = 4              // FeatureType.imageType (ImageFeatureType)
        static let multiArrayType = 5         // FeatureType.multiArrayType (ArrayFeatureType)
        static let dictionaryType = 6         // FeatureType.dictionaryType (DictionaryFeatureType)
        static let sequenceType = 7           // FeatureType.sequenceType (SequenceFeatureType)
        static let stateType = 8              // FeatureType.stateType (StateFeatureType)
        static let isOptional = 1000          // FeatureType.isOptional (bool)
    }

    enum ArrayFeatureType {
        static let shape = 1                  // ArrayFeatureType.shape (repeated int64, packed)
        static let dataType = 2               // ArrayFeatureType.dataType (ArrayDataType enum)
        static let enumeratedShapes = 21      // ArrayFeatureType.enumeratedShapes (EnumeratedShapes)
        static let shapeRange = 31            // ArrayFeatureType.shapeRange (ShapeRange)
    }

    enum EnumeratedShapes {
        static let shapes = 1                 // ArrayFeatureType.EnumeratedShapes.shapes (repeated Shape)
    }

    enum Shape {
        static let shape = 1                  // ArrayFeatureType.Shape.shape (repeated int64, packed)
    }

    enum ShapeRange {
        static let sizeRanges = 1             // ArrayFeatureType.ShapeRange.sizeRanges (repeated SizeRange)
    }

    enum SizeRange {
        static let lowerBound = 1             // SizeRange.lowerBound (uint64)
        static let upperBound = 2             // SizeRange.upperBound (int64, -1 = unbounded)
    }

    enum StateFeatureType {
        static let arrayType = 1              // StateFeatureType.arrayType (ArrayFeatureType)
    }

    // MIL.proto (CoreML.Specification.MILSpec), from coremltools 9.0's MIL_pb2.py.

    enum Program {
        static let version = 1                // Program.version (int64)
        static let functions = 2              // Program.functions (map<string, Function>)
    }

    enum Function {
        static let inputs = 1                 // Function.inputs (repeated NamedValueType)
        static let opset = 2                  // Function.opset (string)
        static let blockSpecializations = 3   // Function.block_specializations (map<string, Block>)
    }

    enum Block {
        static let inputs = 1                 // Block.inputs (repeated NamedValueType)
        static let outputs = 2                // Block.outputs (repeated string)
        static let operations = 3             // Block.operations (repeated Operation)
    }

    enum Operation {
        static let type = 1                   // Operation.type (string)
        static let inputs = 2                 // Operation.inputs (map<string, Argument>)
        static let outputs = 3                // Operation.outputs (repeated NamedValueType)
        static let blocks = 4                 // Operation.blocks (repeated Block)
        static let attributes = 5             // Operation.attributes (map<string, Value>)
    }

    enum Argument {
        static let arguments = 1              // Argument.arguments (repeated Argument.Binding)
    }

    enum Binding {
        static let name = 1                   // Argument.Binding.name (string, oneof binding)
        static let value = 2                  // Argument.Binding.value (Value, oneof binding)
    }

    enum NamedValueType {
        static let name = 1                   // NamedValueType.name (string)
        static let type = 2                   // NamedValueType.type (ValueType)
    }

    enum ValueType {
        static let tensorType = 1             // ValueType.tensorType (TensorType, oneof type)
        static let listType = 2               // ValueType.listType (oneof type)
        static let tupleType = 3              // ValueType.tupleType (oneof type)
        static let dictionaryType = 4         // ValueType.dictionaryType (oneof type)
        static let stateType = 5              // ValueType.stateType (oneof type)
    }

    enum TensorType {
        static let dataType = 1               // TensorType.dataType (DataType enum)
        static let rank = 2                   // TensorType.rank (int64)
        static let dimensions = 3             // TensorType.dimensions (repeated Dimension)
    }

    enum Dimension {
        static let constant = 1               // Dimension.constant (ConstantDimension, oneof dimension)
        static let unknown = 2                // Dimension.unknown (UnknownDimension, oneof dimension)
        static let constantSize = 1           // Dimension.ConstantDimension.size (uint64)
        static let unknownVariadic = 1        // Dimension.UnknownDimension.variadic (bool)
    }

    enum Value {
        static let type = 2                   // Value.type (ValueType)
        static let immediateValue = 3         // Value.immediateValue (oneof value)
        static let blobFileValue = 5          // Value.blobFileValue (oneof value)
    }

    enum ImmediateValue {
        static let tensor = 1                 // Value.ImmediateValue.tensor (TensorValue, oneof value)
    }

    enum StateType {
        static let wrappedType = 1            // StateType.wrappedType (ValueType)
    }

    /// TensorValue's oneof members; each is a message whose field 1 holds the values.
    enum TensorValue {
        static let floats = 1                 // TensorValue.floats (RepeatedFloats: packed float)
        static let ints = 2                   // TensorValue.ints (RepeatedInts: packed int32)
        static let bools = 3                  // TensorValue.bools (RepeatedBools: packed bool)
        static let strings = 4                // TensorValue.strings (RepeatedStrings: repeated string)
        static let longInts = 5               // TensorValue.longInts (RepeatedLongInts: packed int64)
        static let doubles = 6                // TensorValue.doubles (RepeatedDoubles: packed double)
        static let bytes = 7                  // TensorValue.bytes (RepeatedBytes: one bytes field)
        static let values = 1                 // Repeated*.values
    }

    enum BlobFileValue {
        static let fileName = 1               // Value.BlobFileValue.fileName (string)
        static let offset = 2                 // Value.BlobFileValue.offset (uint64)
    }
}
