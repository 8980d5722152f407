from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ErrorReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REASON_UNSPECIFIED: _ClassVar[ErrorReason]
    REASON_CAPACITY: _ClassVar[ErrorReason]
    REASON_KEY_QUOTA: _ClassVar[ErrorReason]
    REASON_HISTORY_REQUIRED: _ClassVar[ErrorReason]
    REASON_SESSION_EVICTED: _ClassVar[ErrorReason]
    REASON_REPLY_TOO_LARGE: _ClassVar[ErrorReason]
    REASON_UNKNOWN_SESSION: _ClassVar[ErrorReason]
    REASON_INVALID_REQUEST: _ClassVar[ErrorReason]
    REASON_UNAUTHENTICATED: _ClassVar[ErrorReason]
    REASON_WRONG_RESUME_TOKEN: _ClassVar[ErrorReason]
    REASON_MODEL_MISMATCH: _ClassVar[ErrorReason]
    REASON_OUT_OF_ORDER: _ClassVar[ErrorReason]
    REASON_TOO_LONG: _ClassVar[ErrorReason]
    REASON_STREAM_IDLE: _ClassVar[ErrorReason]
    REASON_INTERNAL: _ClassVar[ErrorReason]
    REASON_SESSION_FULL: _ClassVar[ErrorReason]
    REASON_NO_DRAFTER: _ClassVar[ErrorReason]
    REASON_STALE_ROUND: _ClassVar[ErrorReason]

class Codec(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CODEC_RAW: _ClassVar[Codec]
    CODEC_FP16_SHUFFLE_ZSTD: _ClassVar[Codec]
    CODEC_INT8_ZSTD: _ClassVar[Codec]
    CODEC_INT4_HADAMARD: _ClassVar[Codec]
    CODEC_INT3_HADAMARD: _ClassVar[Codec]
    CODEC_INT2_HADAMARD: _ClassVar[Codec]

class ClientPartFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CLIENT_PART_TENSORS: _ClassVar[ClientPartFormat]
    CLIENT_PART_ONNX_FP32: _ClassVar[ClientPartFormat]
    CLIENT_PART_ONNX_FP16: _ClassVar[ClientPartFormat]
    CLIENT_PART_ONNX_INT8: _ClassVar[ClientPartFormat]
    CLIENT_PART_TOKENIZER: _ClassVar[ClientPartFormat]
REASON_UNSPECIFIED: ErrorReason
REASON_CAPACITY: ErrorReason
REASON_KEY_QUOTA: ErrorReason
REASON_HISTORY_REQUIRED: ErrorReason
REASON_SESSION_EVICTED: ErrorReason
REASON_REPLY_TOO_LARGE: ErrorReason
REASON_UNKNOWN_SESSION: ErrorReason
REASON_INVALID_REQUEST: ErrorReason
REASON_UNAUTHENTICATED: ErrorReason
REASON_WRONG_RESUME_TOKEN: ErrorReason
REASON_MODEL_MISMATCH: ErrorReason
REASON_OUT_OF_ORDER: ErrorReason
REASON_TOO_LONG: ErrorReason
REASON_STREAM_IDLE: ErrorReason
REASON_INTERNAL: ErrorReason
REASON_SESSION_FULL: ErrorReason
REASON_NO_DRAFTER: ErrorReason
REASON_STALE_ROUND: ErrorReason
CODEC_RAW: Codec
CODEC_FP16_SHUFFLE_ZSTD: Codec
CODEC_INT8_ZSTD: Codec
CODEC_INT4_HADAMARD: Codec
CODEC_INT3_HADAMARD: Codec
CODEC_INT2_HADAMARD: Codec
CLIENT_PART_TENSORS: ClientPartFormat
CLIENT_PART_ONNX_FP32: ClientPartFormat
CLIENT_PART_ONNX_FP16: ClientPartFormat
CLIENT_PART_ONNX_INT8: ClientPartFormat
CLIENT_PART_TOKENIZER: ClientPartFormat

class ErrorDetail(_message.Message):
    __slots__ = ("reason", "retry_after_ms")
    REASON_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    reason: ErrorReason
    retry_after_ms: int
    def __init__(self, reason: _Optional[_Union[ErrorReason, str]] = ..., retry_after_ms: _Optional[int] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("protocol_version", "model_id", "model_config_json", "model_fingerprint", "tokenizer_sha256", "drafter_config_json", "drafter_fingerprint", "tli_layers", "codecs", "max_prompt_tokens", "max_draft_tokens", "max_message_bytes", "client_part_formats", "server_only", "chat_format_json", "max_tree_nodes", "eos_id", "overlapping_rounds", "eos_ids", "clean_up_tokenization_spaces", "sampling_controls", "decode_step_s")
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    MODEL_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_SHA256_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_CONFIG_JSON_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TLI_LAYERS_FIELD_NUMBER: _ClassVar[int]
    CODECS_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    CLIENT_PART_FORMATS_FIELD_NUMBER: _ClassVar[int]
    SERVER_ONLY_FIELD_NUMBER: _ClassVar[int]
    CHAT_FORMAT_JSON_FIELD_NUMBER: _ClassVar[int]
    MAX_TREE_NODES_FIELD_NUMBER: _ClassVar[int]
    EOS_ID_FIELD_NUMBER: _ClassVar[int]
    OVERLAPPING_ROUNDS_FIELD_NUMBER: _ClassVar[int]
    EOS_IDS_FIELD_NUMBER: _ClassVar[int]
    CLEAN_UP_TOKENIZATION_SPACES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_CONTROLS_FIELD_NUMBER: _ClassVar[int]
    DECODE_STEP_S_FIELD_NUMBER: _ClassVar[int]
    protocol_version: int
    model_id: str
    model_config_json: str
    model_fingerprint: str
    tokenizer_sha256: str
    drafter_config_json: str
    drafter_fingerprint: str
    tli_layers: int
    codecs: _containers.RepeatedScalarFieldContainer[Codec]
    max_prompt_tokens: int
    max_draft_tokens: int
    max_message_bytes: int
    client_part_formats: _containers.RepeatedScalarFieldContainer[ClientPartFormat]
    server_only: bool
    chat_format_json: str
    max_tree_nodes: int
    eos_id: int
    overlapping_rounds: bool
    eos_ids: _containers.RepeatedScalarFieldContainer[int]
    clean_up_tokenization_spaces: bool
    sampling_controls: bool
    decode_step_s: float
    def __init__(self, protocol_version: _Optional[int] = ..., model_id: _Optional[str] = ..., model_config_json: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., tokenizer_sha256: _Optional[str] = ..., drafter_config_json: _Optional[str] = ..., drafter_fingerprint: _Optional[str] = ..., tli_layers: _Optional[int] = ..., codecs: _Optional[_Iterable[_Union[Codec, str]]] = ..., max_prompt_tokens: _Optional[int] = ..., max_draft_tokens: _Optional[int] = ..., max_message_bytes: _Optional[int] = ..., client_part_formats: _Optional[_Iterable[_Union[ClientPartFormat, str]]] = ..., server_only: _Optional[bool] = ..., chat_format_json: _Optional[str] = ..., max_tree_nodes: _Optional[int] = ..., eos_id: _Optional[int] = ..., overlapping_rounds: _Optional[bool] = ..., eos_ids: _Optional[_Iterable[int]] = ..., clean_up_tokenization_spaces: _Optional[bool] = ..., sampling_controls: _Optional[bool] = ..., decode_step_s: _Optional[float] = ...) -> None: ...

class TensorEntry(_message.Message):
    __slots__ = ("name", "dtype", "shape", "nbytes", "sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    nbytes: int
    sha256: str
    def __init__(self, name: _Optional[str] = ..., dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., nbytes: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class WeightManifest(_message.Message):
    __slots__ = ("model_fingerprint", "drafter_fingerprint", "tensors", "format")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    DRAFTER_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    drafter_fingerprint: str
    tensors: _containers.RepeatedCompositeFieldContainer[TensorEntry]
    format: ClientPartFormat
    def __init__(self, model_fingerprint: _Optional[str] = ..., drafter_fingerprint: _Optional[str] = ..., tensors: _Optional[_Iterable[_Union[TensorEntry, _Mapping]]] = ..., format: _Optional[_Union[ClientPartFormat, str]] = ...) -> None: ...

class FetchWeightsRequest(_message.Message):
    __slots__ = ("model_fingerprint", "resume_tensor", "resume_offset", "max_chunk_bytes", "manifest_only", "format")
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    RESUME_TENSOR_FIELD_NUMBER: _ClassVar[int]
    RESUME_OFFSET_FIELD_NUMBER: _ClassVar[int]
    MAX_CHUNK_BYTES_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_ONLY_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    model_fingerprint: str
    resume_tensor: str
    resume_offset: int
    max_chunk_bytes: int
    manifest_only: bool
    format: ClientPartFormat
    def __init__(self, model_fingerprint: _Optional[str] = ..., resume_tensor: _Optional[str] = ..., resume_offset: _Optional[int] = ..., max_chunk_bytes: _Optional[int] = ..., manifest_only: _Optional[bool] = ..., format: _Optional[_Union[ClientPartFormat, str]] = ...) -> None: ...

class WeightChunk(_message.Message):
    __slots__ = ("manifest", "chunk")
    MANIFEST_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    manifest: WeightManifest
    chunk: TensorChunk
    def __init__(self, manifest: _Optional[_Union[WeightManifest, _Mapping]] = ..., chunk: _Optional[_Union[TensorChunk, _Mapping]] = ...) -> None: ...

class TensorChunk(_message.Message):
    __slots__ = ("tensor", "offset", "data")
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    tensor: str
    offset: int
    data: bytes
    def __init__(self, tensor: _Optional[str] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_p", "seed", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias", "stop_token_ids", "ignore_eos", "logprobs")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    seed: int
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    logit_bias: _containers.ScalarMap[int, float]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., logit_bias: _Optional[_Mapping[int, float]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token", "logprob", "top_ids", "top_logprobs")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token: int
    logprob: float
    top_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, token: _Optional[int] = ..., logprob: _Optional[float] = ..., top_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class SparseDistribution(_message.Message):
    __slots__ = ("ids", "probs")
    IDS_FIELD_NUMBER: _ClassVar[int]
    PROBS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    probs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, ids: _Optional[_Iterable[int]] = ..., probs: _Optional[_Iterable[float]] = ...) -> None: ...

class KVDelta(_message.Message):
    __slots__ = ("start", "tokens", "payload")
    START_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    start: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    payload: bytes
    def __init__(self, start: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., payload: _Optional[bytes] = ...) -> None: ...

class OpenSession(_message.Message):
    __slots__ = ("request_id", "prompt", "sampling", "max_new_tokens", "delta_codec", "model_fingerprint", "accept_codecs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DELTA_CODEC_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_CODECS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    max_new_tokens: int
    delta_codec: Codec
    model_fingerprint: str
    accept_codecs: _containers.RepeatedScalarFieldContainer[Codec]
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., max_new_tokens: _Optional[int] = ..., delta_codec: _Optional[_Union[Codec, str]] = ..., model_fingerprint: _Optional[str] = ..., accept_codecs: _Optional[_Iterable[_Union[Codec, str]]] = ...) -> None: ...

class DraftRound(_message.Message):
    __slots__ = ("round", "root", "tokens", "q", "parents", "after_length")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    Q_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    AFTER_LENGTH_FIELD_NUMBER: _ClassVar[int]
    round: int
    root: int
    tokens: _containers.RepeatedScalarFieldContainer[int]
    q: _containers.RepeatedCompositeFieldContainer[SparseDistribution]
    parents: _containers.RepeatedScalarFieldContainer[int]
    after_length: int
    def __init__(self, round: _Optional[int] = ..., root: _Optional[int] = ..., tokens: _Optional[_Iterable[int]] = ..., q: _Optional[_Iterable[_Union[SparseDistribution, _Mapping]]] = ..., parents: _Optional[_Iterable[int]] = ..., after_length: _Optional[int] = ...) -> None: ...

class AttachSession(_message.Message):
    __slots__ = ("session_id", "resume_token")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    resume_token: str
    def __init__(self, session_id: _Optional[str] = ..., resume_token: _Optional[str] = ...) -> None: ...

class ClientMessage(_message.Message):
    __slots__ = ("open", "round", "attach")
    OPEN_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ATTACH_FIELD_NUMBER: _ClassVar[int]
    open: OpenSession
    round: DraftRound
    attach: AttachSession
    def __init__(self, open: _Optional[_Union[OpenSession, _Mapping]] = ..., round: _Optional[_Union[DraftRound, _Mapping]] = ..., attach: _Optional[_Union[AttachSession, _Mapping]] = ...) -> None: ...

class Opened(_message.Message):
    __slots__ = ("request_id", "session_id", "resume_token", "first_token", "delta", "delta_parts", "first_logprob")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_FIELD_NUMBER: _ClassVar[int]
    FIRST_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    DELTA_PARTS_FIELD_NUMBER: _ClassVar[int]
    FIRST_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    session_id: str
    resume_token: str
    first_token: int
    delta: KVDelta
    delta_parts: int
    first_logprob: TokenLogprob
    def __init__(self, request_id: _Optional[str] = ..., session_id: _Optional[str] = ..., resume_token: _Optional[str] = ..., first_token: _Optional[int] = ..., delta: _Optional[_Union[KVDelta, _Mapping]] = ..., delta_parts: _Optional[int] = ..., first_logprob: _Optional[_Union[TokenLogprob, _Mapping]] = ...) -> None: ...

class Verdict(_message.Message):
    __slots__ = ("round", "accepted", "bonus", "delta", "path", "logprobs")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    BONUS_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    round: int
    accepted: int
    bonus: int
    delta: KVDelta
    path: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, round: _Optional[int] = ..., accepted: _Optional[int] = ..., bonus: _Optional[int] = ..., delta: _Optional[_Union[KVDelta, _Mapping]] = ..., path: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("code", "message", "round", "reason", "retry_after_ms")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_MS_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    round: int
    reason: ErrorReason
    retry_after_ms: int
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ..., round: _Optional[int] = ..., reason: _Optional[_Union[ErrorReason, str]] = ..., retry_after_ms: _Optional[int] = ...) -> None: ...

class Attached(_message.Message):
    __slots__ = ("session_id", "verified_length", "root", "last_round")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ROOT_FIELD_NUMBER: _ClassVar[int]
    LAST_ROUND_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    verified_length: int
    root: int
    last_round: int
    def __init__(self, session_id: _Optional[str] = ..., verified_length: _Optional[int] = ..., root: _Optional[int] = ..., last_round: _Optional[int] = ...) -> None: ...

class ServerMessage(_message.Message):
    __slots__ = ("opened", "verdict", "error", "attached", "delta")
    OPENED_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    opened: Opened
    verdict: Verdict
    error: Error
    attached: Attached
    delta: KVDelta
    def __init__(self, opened: _Optional[_Union[Opened, _Mapping]] = ..., verdict: _Optional[_Union[Verdict, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., attached: _Optional[_Union[Attached, _Mapping]] = ..., delta: _Optional[_Union[KVDelta, _Mapping]] = ...) -> None: ...

class ResyncRequest(_message.Message):
    __slots__ = ("session_id", "resume_token", "verified_length", "offline_tokens", "history", "sampling", "delta_codec", "model_fingerprint", "rewind", "prompt_length", "accept_codecs")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    OFFLINE_TOKENS_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DELTA_CODEC_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    REWIND_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_CODECS_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    resume_token: str
    verified_length: int
    offline_tokens: _containers.RepeatedScalarFieldContainer[int]
    history: _containers.RepeatedScalarFieldContainer[int]
    sampling: SamplingParams
    delta_codec: Codec
    model_fingerprint: str
    rewind: bool
    prompt_length: int
    accept_codecs: _containers.RepeatedScalarFieldContainer[Codec]
    def __init__(self, session_id: _Optional[str] = ..., resume_token: _Optional[str] = ..., verified_length: _Optional[int] = ..., offline_tokens: _Optional[_Iterable[int]] = ..., history: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[SamplingParams, _Mapping]] = ..., delta_codec: _Optional[_Union[Codec, str]] = ..., model_fingerprint: _Optional[str] = ..., rewind: _Optional[bool] = ..., prompt_length: _Optional[int] = ..., accept_codecs: _Optional[_Iterable[_Union[Codec, str]]] = ...) -> None: ...

class ResyncReply(_message.Message):
    __slots__ = ("session_id", "resume_token", "rebuilt", "first_disagreement", "target_token", "verified_length", "delta", "target_logprob")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    RESUME_TOKEN_FIELD_NUMBER: _ClassVar[int]
    REBUILT_FIELD_NUMBER: _ClassVar[int]
    FIRST_DISAGREEMENT_FIELD_NUMBER: _ClassVar[int]
    TARGET_TOKEN_FIELD_NUMBER: _ClassVar[int]
    VERIFIED_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DELTA_FIELD_NUMBER: _ClassVar[int]
    TARGET_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    resume_token: str
    rebuilt: bool
    first_disagreement: int
    target_token: int
    verified_length: int
    delta: KVDelta
    target_logprob: TokenLogprob
    def __init__(self, session_id: _Optional[str] = ..., resume_token: _Optional[str] = ..., rebuilt: _Optional[bool] = ..., first_disagreement: _Optional[int] = ..., target_token: _Optional[int] = ..., verified_length: _Optional[int] = ..., delta: _Optional[_Union[KVDelta, _Mapping]] = ..., target_logprob: _Optional[_Union[TokenLogprob, _Mapping]] = ...) -> None: ...

class CloseRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class CloseReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GeneratedTokens(_message.Message):
    __slots__ = ("tokens", "logprobs")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...
