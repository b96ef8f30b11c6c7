"""The rules of the client loop that every driver of it follows.

Two things drive the client loop: :class:`~murmura.client.ClientRuntime` (a deployed client,
over gRPC or the in-memory transport) and the simulator's discrete-event engine (thousands of
virtual clients in virtual time). Both take these pieces from here rather than each keeping a
copy, so a simulated client picks its codec, seeds its encoder, names its updates and reacts to
a refusal exactly as a deployed one does:

* :func:`codec_choice`, :func:`encoder_seed`, :func:`make_encoder`: which codec a client
  encodes with, with which options, and how its encoder's randomness is seeded;
* :class:`UpdateIds`: update ids, 12 characters (the length the simulator's wire budget and
  the benchmarks' byte counts assume), random by default and reproducible from a seed;
* :func:`after_refusal`: what to do when the aggregator refuses a request; how long to wait
  before a retry, and when to give up, is :class:`~murmura.client.retry.RetryPolicy`'s (the
  gossip peers back off with it too).
"""

from __future__ import annotations

import base64
import random
import secrets
import uuid
from typing import Literal

from murmura.client.transport import RETRYABLE
from murmura.protocols import Encoder, TaskSettings, create_codec

__all__ = [
    "AUTO_CODECS",
    "UPDATE_ID_LENGTH",
    "RefusalAction",
    "UpdateIds",
    "after_refusal",
    "auto_codec",
    "auto_switch",
    "codec_choice",
    "encoder_seed",
    "make_encoder",
    "run_is_over",
]

#: Characters in an update id: 72 random bits in URL-safe base64.
UPDATE_ID_LENGTH = 12
_ID_BYTES = 9  # 9 bytes -> 12 base64 characters, no padding

RefusalAction = Literal["rejoin", "next_task", "retry"]


def encoder_seed(client_id: str) -> int:
    """The 32-bit seed of a client's encoder, from its id (uuid5).

    A function of the id alone: a restarted client draws the same codec randomness (random
    projections, stochastic rounding) as before, and a simulated client the same as the
    deployed client of that id.
    """
    return int.from_bytes(uuid.uuid5(uuid.NAMESPACE_OID, client_id).bytes[:4], "big")


def codec_choice(settings: TaskSettings, codec: str = "") -> tuple[str, dict[str, str]]:
    """The codec a client encodes with and its options.

    The client's own ``codec`` when it names one, else the server's (``settings.codec``). The
    server's codec options apply only to the server's codec: options meant for one codec
    would be rejected by (or mislead) another.
    """
    name = codec or settings.codec
    options = dict(settings.codec_options) if name == settings.codec else {}
    return name, options


#: ``--codec auto``'s choices, most faithful first: (name, options, payload bytes as a fraction
#: of dense float32). int8 is ~4x smaller at no measured accuracy cost on digits; top-k 1 %
#: (index + value per kept entry) ~50x smaller at -0.8 points (docs/codecs.md).
AUTO_CODECS: tuple[tuple[str, dict[str, str], float], ...] = (
    ("dense-f32", {}, 1.0),
    ("int8", {}, 0.25),
    ("topk", {"ratio": "0.01"}, 0.02),
)


def auto_codec(dense_bytes: int, uplink_bytes_per_s: float, train_s: float, *,
               budget: float = 0.1, floor_s: float = 0.1) -> tuple[str, dict[str, str]]:
    """The most faithful codec whose upload takes at most ``budget`` of the training time
    (or ``floor_s``, whichever is longer) on a link measured at ``uplink_bytes_per_s``; the
    smallest codec when none fits."""
    if not (uplink_bytes_per_s > 0 and dense_bytes >= 0):
        raise ValueError("auto_codec needs a positive measured link speed")
    allowed = max(budget * max(train_s, 0.0), floor_s)
    for name, options, fraction in AUTO_CODECS:
        if dense_bytes * fraction / uplink_bytes_per_s <= allowed:
            return name, dict(options)
    name, options, _ = AUTO_CODECS[-1]
    return name, dict(options)


def auto_switch(dense_bytes: int, payload_bytes: int, push_s: float, train_s: float,
                current: str) -> tuple[str, dict[str, str]] | None:
    """``codec='auto'``, after a client's first push: the codec for its next updates, chosen
    from that push's measured speed (:func:`auto_codec`); None keeps ``current`` (the choice
    is the same, or the push took no measurable time). The client runtime and the
    simulator's virtual clients both decide with it."""
    if push_s <= 0:
        return None
    name, options = auto_codec(dense_bytes, payload_bytes / push_s, train_s)
    return None if name == current else (name, options)


def make_encoder(settings: TaskSettings, spec_size: int, client_id: str,
                 codec: str = "") -> Encoder:
    """A fresh encoder for client ``client_id``: :func:`codec_choice`, seeded with
    :func:`encoder_seed`. Raises the codec registry's error for an unknown codec or option."""
    if spec_size < 1:
        raise ValueError(f"spec_size must be >= 1, got {spec_size}")
    name, options = codec_choice(settings, codec)
    return create_codec(name, options).encoder(spec_size, seed=encoder_seed(client_id))


class UpdateIds:
    """A source of update ids, each :data:`UPDATE_ID_LENGTH` URL-safe characters.

    The aggregator counts an update once per (client, update id), so a retried push keeps its
    id. Without a ``seed`` the ids are random (:mod:`secrets`): 72 bits make a collision
    between one client's updates negligible for any realistic number of pushes, and a restarted
    client never reuses an id of its earlier life. This is what :class:`ClientRuntime` uses by
    default. With a ``seed`` the sequence is reproducible (the simulator, whose reruns must be
    identical); it is not meant to be unguessable.
    """

    def __init__(self, seed: int | None = None) -> None:
        self._rng = None if seed is None else random.Random(seed)

    def __call__(self) -> str:
        """The next id."""
        if self._rng is None:
            return secrets.token_urlsafe(_ID_BYTES)
        return base64.urlsafe_b64encode(self._rng.randbytes(_ID_BYTES)).decode("ascii")


#: What the aggregator says when it refuses an update because the run has ended (or its last
#: version is being made): server/core.py's ``_finished_message`` ends with it.
RUN_OVER_TEXT = "no more updates are taken"


def run_is_over(status: str, message: str) -> bool:
    """Whether a refusal only means the run has ended: a normal finish, not a problem (an
    async run's last updates arrive after its last version and are refused this way)."""
    return status == "FAILED_PRECONDITION" and RUN_OVER_TEXT in message


def after_refusal(status: str, retry_after_s: float | None = None) -> RefusalAction:
    """What a client does when the aggregator refuses a request with gRPC status ``status``.

    ``retry_after_s`` is the server's hint that the refusal is temporary (back-pressure:
    RESOURCE_EXHAUSTED while its workers or memory are busy); such a refusal is retried.

    * ``"rejoin"``: the session is gone (``UNAUTHENTICATED``: the server restarted, or the
      client had left): join again, then send the same request again with the new session;
    * ``"retry"``: the server is away or overloaded (:data:`RETRYABLE` statuses): send the same
      request again after a :class:`~murmura.client.retry.RetryPolicy` pause, until it
      gives up;
    * ``"next_task"``: the request can't succeed as sent (a stale or malformed update, a
      finished run...): drop the work in hand and ask for the next task.
    """
    if status == "UNAUTHENTICATED":
        return "rejoin"
    if status in RETRYABLE or retry_after_s is not None:
        return "retry"
    return "next_task"
