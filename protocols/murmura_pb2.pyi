from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TensorSpec(_message.Message):
    __slots__ = ("name", "shape", "dtype")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: str
    def __init__(self, name: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[str] = ...) -> None: ...

class ModelSpec(_message.Message):
    __slots__ = ("tensors",)
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    tensors: _containers.RepeatedCompositeFieldContainer[TensorSpec]
    def __init__(self, tensors: _Optional[_Iterable[_Union[TensorSpec, _Mapping]]] = ...) -> None: ...

class DeviceProfile(_message.Message):
    __slots__ = ("device", "device_name", "memory_bytes", "steps_per_s", "cpu_count", "extra")
    class ExtraEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_NAME_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    STEPS_PER_S_FIELD_NUMBER: _ClassVar[int]
    CPU_COUNT_FIELD_NUMBER: _ClassVar[int]
    EXTRA_FIELD_NUMBER: _ClassVar[int]
    device: str
    device_name: str
    memory_bytes: int
    steps_per_s: float
    cpu_count: int
    extra: _containers.ScalarMap[str, str]
    def __init__(self, device: _Optional[str] = ..., device_name: _Optional[str] = ..., memory_bytes: _Optional[int] = ..., steps_per_s: _Optional[float] = ..., cpu_count: _Optional[int] = ..., extra: _Optional[_Mapping[str, str]] = ...) -> None: ...

class TaskSettings(_message.Message):
    __slots__ = ("trainer", "local_epochs", "local_steps", "batch_size", "lr", "momentum", "codec", "codec_options", "seed", "zo_eps", "client_eval_every")
    class CodecOptionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    TRAINER_FIELD_NUMBER: _ClassVar[int]
    LOCAL_EPOCHS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    LR_FIELD_NUMBER: _ClassVar[int]
    MOMENTUM_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    CODEC_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    ZO_EPS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_EVAL_EVERY_FIELD_NUMBER: _ClassVar[int]
    trainer: str
    local_epochs: int
    local_steps: int
    batch_size: int
    lr: float
    momentum: float
    codec: str
    codec_options: _containers.ScalarMap[str, str]
    seed: int
    zo_eps: float
    client_eval_every: int
    def __init__(self, trainer: _Optional[str] = ..., local_epochs: _Optional[int] = ..., local_steps: _Optional[int] = ..., batch_size: _Optional[int] = ..., lr: _Optional[float] = ..., momentum: _Optional[float] = ..., codec: _Optional[str] = ..., codec_options: _Optional[_Mapping[str, str]] = ..., seed: _Optional[int] = ..., zo_eps: _Optional[float] = ..., client_eval_every: _Optional[int] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("client_id", "profile", "token", "protocol_version", "public_key", "nonce", "signature")
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    PROFILE_FIELD_NUMBER: _ClassVar[int]
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_VERSION_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    client_id: str
    profile: DeviceProfile
    token: str
    protocol_version: int
    public_key: bytes
    nonce: bytes
    signature: bytes
    def __init__(self, client_id: _Optional[str] = ..., profile: _Optional[_Union[DeviceProfile, _Mapping]] = ..., token: _Optional[str] = ..., protocol_version: _Optional[int] = ..., public_key: _Optional[bytes] = ..., nonce: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class ChallengeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ChallengeReply(_message.Message):
    __slots__ = ("nonce", "expires_in_s")
    NONCE_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_IN_S_FIELD_NUMBER: _ClassVar[int]
    nonce: bytes
    expires_in_s: float
    def __init__(self, nonce: _Optional[bytes] = ..., expires_in_s: _Optional[float] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("session", "settings", "spec", "mode", "max_payload_bytes", "secagg", "push_port")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    SETTINGS_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    MODE_FIELD_NUMBER: _ClassVar[int]
    MAX_PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECAGG_FIELD_NUMBER: _ClassVar[int]
    PUSH_PORT_FIELD_NUMBER: _ClassVar[int]
    session: str
    settings: TaskSettings
    spec: ModelSpec
    mode: str
    max_payload_bytes: int
    secagg: SecAggParams
    push_port: int
    def __init__(self, session: _Optional[str] = ..., settings: _Optional[_Union[TaskSettings, _Mapping]] = ..., spec: _Optional[_Union[ModelSpec, _Mapping]] = ..., mode: _Optional[str] = ..., max_payload_bytes: _Optional[int] = ..., secagg: _Optional[_Union[SecAggParams, _Mapping]] = ..., push_port: _Optional[int] = ...) -> None: ...

class TaskRequest(_message.Message):
    __slots__ = ("session", "wait_s")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    session: str
    wait_s: float
    def __init__(self, session: _Optional[str] = ..., wait_s: _Optional[float] = ...) -> None: ...

class TaskReply(_message.Message):
    __slots__ = ("action", "version", "round", "retry_after_s", "seed", "local_steps")
    class Action(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        WAIT: _ClassVar[TaskReply.Action]
        TRAIN: _ClassVar[TaskReply.Action]
        STOP: _ClassVar[TaskReply.Action]
    WAIT: TaskReply.Action
    TRAIN: TaskReply.Action
    STOP: TaskReply.Action
    ACTION_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    RETRY_AFTER_S_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    LOCAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    action: TaskReply.Action
    version: int
    round: int
    retry_after_s: float
    seed: int
    local_steps: int
    def __init__(self, action: _Optional[_Union[TaskReply.Action, str]] = ..., version: _Optional[int] = ..., round: _Optional[int] = ..., retry_after_s: _Optional[float] = ..., seed: _Optional[int] = ..., local_steps: _Optional[int] = ...) -> None: ...

class PullRequest(_message.Message):
    __slots__ = ("session", "kind")
    class Kind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        MODEL: _ClassVar[PullRequest.Kind]
        POOL_BASE: _ClassVar[PullRequest.Kind]
        POOL_SCALARS: _ClassVar[PullRequest.Kind]
    MODEL: PullRequest.Kind
    POOL_BASE: PullRequest.Kind
    POOL_SCALARS: PullRequest.Kind
    SESSION_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    session: str
    kind: PullRequest.Kind
    def __init__(self, session: _Optional[str] = ..., kind: _Optional[_Union[PullRequest.Kind, str]] = ...) -> None: ...

class ModelHeader(_message.Message):
    __slots__ = ("version", "spec", "codec", "payload_bytes", "base_version")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    SPEC_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    spec: ModelSpec
    codec: str
    payload_bytes: int
    base_version: int
    def __init__(self, version: _Optional[int] = ..., spec: _Optional[_Union[ModelSpec, _Mapping]] = ..., codec: _Optional[str] = ..., payload_bytes: _Optional[int] = ..., base_version: _Optional[int] = ...) -> None: ...

class ModelChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: ModelHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[ModelHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class UpdateHeader(_message.Message):
    __slots__ = ("session", "update_id", "base_version", "round", "num_examples", "codec", "payload_bytes", "metrics", "spec_fingerprint", "signature")
    class MetricsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: float
        def __init__(self, key: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...
    SESSION_FIELD_NUMBER: _ClassVar[int]
    UPDATE_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_VERSION_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    NUM_EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    SPEC_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    session: str
    update_id: str
    base_version: int
    round: int
    num_examples: int
    codec: str
    payload_bytes: int
    metrics: _containers.ScalarMap[str, float]
    spec_fingerprint: str
    signature: bytes
    def __init__(self, session: _Optional[str] = ..., update_id: _Optional[str] = ..., base_version: _Optional[int] = ..., round: _Optional[int] = ..., num_examples: _Optional[int] = ..., codec: _Optional[str] = ..., payload_bytes: _Optional[int] = ..., metrics: _Optional[_Mapping[str, float]] = ..., spec_fingerprint: _Optional[str] = ..., signature: _Optional[bytes] = ...) -> None: ...

class UpdateChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: UpdateHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[UpdateHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PushReply(_message.Message):
    __slots__ = ("duplicate", "version", "staleness")
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    STALENESS_FIELD_NUMBER: _ClassVar[int]
    duplicate: bool
    version: int
    staleness: int
    def __init__(self, duplicate: _Optional[bool] = ..., version: _Optional[int] = ..., staleness: _Optional[int] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("session", "reason")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    session: str
    reason: str
    def __init__(self, session: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class SecAggParams(_message.Message):
    __slots__ = ("enabled", "bits", "clip", "max_weight", "dp_clip", "dp_noise_multiplier")
    ENABLED_FIELD_NUMBER: _ClassVar[int]
    BITS_FIELD_NUMBER: _ClassVar[int]
    CLIP_FIELD_NUMBER: _ClassVar[int]
    MAX_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    DP_CLIP_FIELD_NUMBER: _ClassVar[int]
    DP_NOISE_MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    enabled: bool
    bits: int
    clip: float
    max_weight: float
    dp_clip: float
    dp_noise_multiplier: float
    def __init__(self, enabled: _Optional[bool] = ..., bits: _Optional[int] = ..., clip: _Optional[float] = ..., max_weight: _Optional[float] = ..., dp_clip: _Optional[float] = ..., dp_noise_multiplier: _Optional[float] = ...) -> None: ...

class SecAggKeys(_message.Message):
    __slots__ = ("session", "round", "mask_public_key", "enc_public_key", "self_commitment", "signature")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    MASK_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    ENC_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    SELF_COMMITMENT_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    session: str
    round: int
    mask_public_key: bytes
    enc_public_key: bytes
    self_commitment: bytes
    signature: bytes
    def __init__(self, session: _Optional[str] = ..., round: _Optional[int] = ..., mask_public_key: _Optional[bytes] = ..., enc_public_key: _Optional[bytes] = ..., self_commitment: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class SecAggCiphertext(_message.Message):
    __slots__ = ("peer", "ciphertext")
    PEER_FIELD_NUMBER: _ClassVar[int]
    CIPHERTEXT_FIELD_NUMBER: _ClassVar[int]
    peer: int
    ciphertext: bytes
    def __init__(self, peer: _Optional[int] = ..., ciphertext: _Optional[bytes] = ...) -> None: ...

class SecAggShares(_message.Message):
    __slots__ = ("session", "round", "shares")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SHARES_FIELD_NUMBER: _ClassVar[int]
    session: str
    round: int
    shares: _containers.RepeatedCompositeFieldContainer[SecAggCiphertext]
    def __init__(self, session: _Optional[str] = ..., round: _Optional[int] = ..., shares: _Optional[_Iterable[_Union[SecAggCiphertext, _Mapping]]] = ...) -> None: ...

class SecAggShare(_message.Message):
    __slots__ = ("owner", "key", "y")
    OWNER_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    Y_FIELD_NUMBER: _ClassVar[int]
    owner: int
    key: bool
    y: bytes
    def __init__(self, owner: _Optional[int] = ..., key: _Optional[bool] = ..., y: _Optional[bytes] = ...) -> None: ...

class SecAggUnmask(_message.Message):
    __slots__ = ("session", "round", "shares")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SHARES_FIELD_NUMBER: _ClassVar[int]
    session: str
    round: int
    shares: _containers.RepeatedCompositeFieldContainer[SecAggShare]
    def __init__(self, session: _Optional[str] = ..., round: _Optional[int] = ..., shares: _Optional[_Iterable[_Union[SecAggShare, _Mapping]]] = ...) -> None: ...

class SecAggAck(_message.Message):
    __slots__ = ("round",)
    ROUND_FIELD_NUMBER: _ClassVar[int]
    round: int
    def __init__(self, round: _Optional[int] = ...) -> None: ...

class SecAggPollRequest(_message.Message):
    __slots__ = ("session", "round", "wait_s", "after")
    SESSION_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    WAIT_S_FIELD_NUMBER: _ClassVar[int]
    AFTER_FIELD_NUMBER: _ClassVar[int]
    session: str
    round: int
    wait_s: float
    after: SecAggState.Stage
    def __init__(self, session: _Optional[str] = ..., round: _Optional[int] = ..., wait_s: _Optional[float] = ..., after: _Optional[_Union[SecAggState.Stage, str]] = ...) -> None: ...

class SecAggPeer(_message.Message):
    __slots__ = ("index", "client_id", "mask_public_key", "enc_public_key", "self_commitment", "identity_key", "signature")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ID_FIELD_NUMBER: _ClassVar[int]
    MASK_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    ENC_PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    SELF_COMMITMENT_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_KEY_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    index: int
    client_id: str
    mask_public_key: bytes
    enc_public_key: bytes
    self_commitment: bytes
    identity_key: bytes
    signature: bytes
    def __init__(self, index: _Optional[int] = ..., client_id: _Optional[str] = ..., mask_public_key: _Optional[bytes] = ..., enc_public_key: _Optional[bytes] = ..., self_commitment: _Optional[bytes] = ..., identity_key: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...

class SecAggState(_message.Message):
    __slots__ = ("round", "stage", "index", "threshold", "n_max", "neighbours", "ciphertexts", "included", "dropped", "reason", "factor", "min_inputs")
    class Stage(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        KEYS: _ClassVar[SecAggState.Stage]
        SHARES: _ClassVar[SecAggState.Stage]
        INPUT: _ClassVar[SecAggState.Stage]
        UNMASK: _ClassVar[SecAggState.Stage]
        DONE: _ClassVar[SecAggState.Stage]
        ABANDONED: _ClassVar[SecAggState.Stage]
    KEYS: SecAggState.Stage
    SHARES: SecAggState.Stage
    INPUT: SecAggState.Stage
    UNMASK: SecAggState.Stage
    DONE: SecAggState.Stage
    ABANDONED: SecAggState.Stage
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    INDEX_FIELD_NUMBER: _ClassVar[int]
    THRESHOLD_FIELD_NUMBER: _ClassVar[int]
    N_MAX_FIELD_NUMBER: _ClassVar[int]
    NEIGHBOURS_FIELD_NUMBER: _ClassVar[int]
    CIPHERTEXTS_FIELD_NUMBER: _ClassVar[int]
    INCLUDED_FIELD_NUMBER: _ClassVar[int]
    DROPPED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    FACTOR_FIELD_NUMBER: _ClassVar[int]
    MIN_INPUTS_FIELD_NUMBER: _ClassVar[int]
    round: int
    stage: SecAggState.Stage
    index: int
    threshold: int
    n_max: int
    neighbours: _containers.RepeatedCompositeFieldContainer[SecAggPeer]
    ciphertexts: _containers.RepeatedCompositeFieldContainer[SecAggCiphertext]
    included: _containers.RepeatedScalarFieldContainer[int]
    dropped: _containers.RepeatedScalarFieldContainer[int]
    reason: str
    factor: float
    min_inputs: int
    def __init__(self, round: _Optional[int] = ..., stage: _Optional[_Union[SecAggState.Stage, str]] = ..., index: _Optional[int] = ..., threshold: _Optional[int] = ..., n_max: _Optional[int] = ..., neighbours: _Optional[_Iterable[_Union[SecAggPeer, _Mapping]]] = ..., ciphertexts: _Optional[_Iterable[_Union[SecAggCiphertext, _Mapping]]] = ..., included: _Optional[_Iterable[int]] = ..., dropped: _Optional[_Iterable[int]] = ..., reason: _Optional[str] = ..., factor: _Optional[float] = ..., min_inputs: _Optional[int] = ...) -> None: ...

class PeerInfo(_message.Message):
    __slots__ = ("peer_id", "address", "round", "age", "public_key")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    AGE_FIELD_NUMBER: _ClassVar[int]
    PUBLIC_KEY_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    address: str
    round: int
    age: int
    public_key: bytes
    def __init__(self, peer_id: _Optional[str] = ..., address: _Optional[str] = ..., round: _Optional[int] = ..., age: _Optional[int] = ..., public_key: _Optional[bytes] = ...) -> None: ...

class PeerExchange(_message.Message):
    __slots__ = ("sender", "peers", "spec_fingerprint", "signature", "history")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    PEERS_FIELD_NUMBER: _ClassVar[int]
    SPEC_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    HISTORY_FIELD_NUMBER: _ClassVar[int]
    sender: PeerInfo
    peers: _containers.RepeatedCompositeFieldContainer[PeerInfo]
    spec_fingerprint: str
    signature: bytes
    history: _containers.RepeatedCompositeFieldContainer[HistoryRecord]
    def __init__(self, sender: _Optional[_Union[PeerInfo, _Mapping]] = ..., peers: _Optional[_Iterable[_Union[PeerInfo, _Mapping]]] = ..., spec_fingerprint: _Optional[str] = ..., signature: _Optional[bytes] = ..., history: _Optional[_Iterable[_Union[HistoryRecord, _Mapping]]] = ...) -> None: ...

class HistoryRecord(_message.Message):
    __slots__ = ("peer_id", "round", "sketch")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    SKETCH_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    round: int
    sketch: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, peer_id: _Optional[str] = ..., round: _Optional[int] = ..., sketch: _Optional[_Iterable[float]] = ...) -> None: ...

class PeerModelHeader(_message.Message):
    __slots__ = ("sender", "message_id", "round", "num_examples", "codec", "payload_bytes", "spec_fingerprint", "signature", "kind")
    SENDER_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    NUM_EXAMPLES_FIELD_NUMBER: _ClassVar[int]
    CODEC_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_BYTES_FIELD_NUMBER: _ClassVar[int]
    SPEC_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    sender: PeerInfo
    message_id: str
    round: int
    num_examples: int
    codec: str
    payload_bytes: int
    spec_fingerprint: str
    signature: bytes
    kind: str
    def __init__(self, sender: _Optional[_Union[PeerInfo, _Mapping]] = ..., message_id: _Optional[str] = ..., round: _Optional[int] = ..., num_examples: _Optional[int] = ..., codec: _Optional[str] = ..., payload_bytes: _Optional[int] = ..., spec_fingerprint: _Optional[str] = ..., signature: _Optional[bytes] = ..., kind: _Optional[str] = ...) -> None: ...

class PeerChunk(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: PeerModelHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[PeerModelHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class PeerPushReply(_message.Message):
    __slots__ = ("duplicate", "round")
    DUPLICATE_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    duplicate: bool
    round: int
    def __init__(self, duplicate: _Optional[bool] = ..., round: _Optional[int] = ...) -> None: ...

class PeerPullRequest(_message.Message):
    __slots__ = ("peer_id", "snapshot")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    snapshot: bool
    def __init__(self, peer_id: _Optional[str] = ..., snapshot: _Optional[bool] = ...) -> None: ...

class PeerStepLogs(_message.Message):
    __slots__ = ("snapshot_round", "snapshot_sha256", "rounds")
    SNAPSHOT_ROUND_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_SHA256_FIELD_NUMBER: _ClassVar[int]
    ROUNDS_FIELD_NUMBER: _ClassVar[int]
    snapshot_round: int
    snapshot_sha256: bytes
    rounds: _containers.RepeatedCompositeFieldContainer[PeerRoundLogs]
    def __init__(self, snapshot_round: _Optional[int] = ..., snapshot_sha256: _Optional[bytes] = ..., rounds: _Optional[_Iterable[_Union[PeerRoundLogs, _Mapping]]] = ...) -> None: ...

class PeerRoundLogs(_message.Message):
    __slots__ = ("round", "logs")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    LOGS_FIELD_NUMBER: _ClassVar[int]
    round: int
    logs: _containers.RepeatedCompositeFieldContainer[PeerStepLog]
    def __init__(self, round: _Optional[int] = ..., logs: _Optional[_Iterable[_Union[PeerStepLog, _Mapping]]] = ...) -> None: ...

class PeerStepLog(_message.Message):
    __slots__ = ("peer_id", "payload")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    payload: bytes
    def __init__(self, peer_id: _Optional[str] = ..., payload: _Optional[bytes] = ...) -> None: ...

class PeerHealthRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class PeerHealthReply(_message.Message):
    __slots__ = ("peer_id", "round", "view_size", "training")
    PEER_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    VIEW_SIZE_FIELD_NUMBER: _ClassVar[int]
    TRAINING_FIELD_NUMBER: _ClassVar[int]
    peer_id: str
    round: int
    view_size: int
    training: bool
    def __init__(self, peer_id: _Optional[str] = ..., round: _Optional[int] = ..., view_size: _Optional[int] = ..., training: _Optional[bool] = ...) -> None: ...
