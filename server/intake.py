"""Intake: the aggregator's job of taking an update in.

The push steps the pipeline (server/pipeline.py) runs: ``precheck`` (the header alone),
``begin_push`` (the payload's length, rate limits, duplicates), ``finish_push`` (staleness,
the aggregate's bound, the durable record, the policy) or ``abort_push``, plus the checks
behind them (signatures, partial aggregates from leaves) and the count of refusals.
:class:`~murmura.server.core.AggregatorCore` takes these methods from :class:`IntakeJob`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, cast

from murmura.protocols import (
    FlatVector,
    PushResult,
    UpdateHeader,
)
from murmura.protocols.identity import (
    SIGNATURE_BYTES,
    signed_update_message,
    verify,
)
from murmura.server.client_eval import report_from_metrics
from murmura.server.decoding import PARTIAL_CODEC, Decoded
from murmura.server.errors import (
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    ServiceError,
    Unavailable,
)
from murmura.server.limits import (
    MAX_NUM_EXAMPLES,
    check_header,
    quote,
)
from murmura.server.sessions import ClientRecord
from murmura.server.state import (
    DropPush,
    RecordPush,
    SpoolRef,
)

if TYPE_CHECKING:
    from murmura.server.core import AggregatorCore
    from murmura.server.pipeline import PushPipeline

log = logging.getLogger(__name__)

#: The most client updates one partial aggregate may stand for.
MAX_PARTIAL_COUNT = 1 << 31

#: The most distinct ``STATUS: reason`` keys counted; later new ones count as ``STATUS: other``.
MAX_REFUSAL_REASONS = 64
#: Headers remembered as validated (by identity): pushes received at once, each checked at
#: its precheck, are not checked again at their begin_push.
VALID_HEADERS = 256


_HEADER_FIELDS = tuple(f.name for f in dataclasses.fields(UpdateHeader))


def _header_record(header: UpdateHeader) -> dict[str, Any]:
    """The header as JSON-ready fields (the signature as hex) for the pending-updates table.

    Built field by field (``dataclasses.asdict`` deep-copies recursively, a tenth of the
    durable push's work on the event loop); the metrics dict is the one field to copy."""
    record = {name: getattr(header, name) for name in _HEADER_FIELDS}
    record["metrics"] = dict(header.metrics)
    record["signature"] = header.signature.hex()
    return record


class IntakeJob:
    """Taking updates in: the push steps and their checks (mixed into the core)."""

    #: attributes this job assigns (declared in AggregatorCore.__init__)
    last_durable: Future[Any] | None
    fold_mass: float
    _seq: int
    _valid_headers: OrderedDict[int, UpdateHeader]
    _pipeline: PushPipeline | None

    if TYPE_CHECKING:  # the core's state, typed where AggregatorCore declares it
        def __getattr__(self, name: str) -> Any: ...


    def count_refusal(self, refusal: ServiceError | str, reason: str = "") -> None:
        """Count one refused request by its status and by ``STATUS: reason`` (the metrics
        rows and summary.json report both); an error that was counted already is not counted
        again. A bare status names its ``reason`` here."""
        if isinstance(refusal, ServiceError):
            if refusal.counted:
                return
            refusal.counted = True
            status, key = refusal.status, refusal.key
        else:
            status, key = refusal, f"{refusal}: {reason or 'no reason given'}"
        self.traffic.refused[status] = self.traffic.refused.get(status, 0) + 1
        by_reason = self.traffic.refused_by_reason
        if key not in by_reason and len(by_reason) >= MAX_REFUSAL_REASONS:
            key = f"{status}: other"  # bounded: odd messages cannot grow the rows
        by_reason[key] = by_reason.get(key, 0) + 1

    @staticmethod
    def _check_partial(decoded: Decoded) -> None:
        """A partial's count and weight must be those of real updates: each counts once and
        weighs its example count (an integer from 1 to MAX_NUM_EXAMPLES), so its step, sum
        over weight, is bounded like one update's (a tiny weight would escape the fold bound)."""
        count, weight = int(decoded.count), float(decoded.weight or 0.0)
        if not 1 <= count <= MAX_PARTIAL_COUNT:
            raise InvalidArgument(f"a partial aggregate's count must lie in [1, "
                                  f"{MAX_PARTIAL_COUNT}], got {count}")
        if not count <= weight <= count * MAX_NUM_EXAMPLES:
            raise InvalidArgument(f"a partial aggregate of {count} updates must weigh between "
                                  f"{count} and {count} x {MAX_NUM_EXAMPLES} (one example count "
                                  f"each), got {weight:.6g}")

    def _check_signature(self, rec: ClientRecord, header: UpdateHeader,
                         digest: bytes | None) -> None:
        """Refuse an update its session's key did not sign, or a payload already counted
        from another client (a captured update re-signed by a second identity)."""
        if digest is None or not rec.public_key:
            raise FailedPrecondition("this update cannot be checked: its session has no key")
        if not verify(rec.public_key, header.signature, signed_update_message(header, digest)):
            raise PermissionDenied("the update's signature does not verify with this session's "
                                   "key (modified, replayed from another session, or forged)")
        owner = self._counted.get(digest)
        if owner is not None and owner != rec.client_id:
            raise PermissionDenied("this payload was already counted from another client; a "
                                   "copied update is refused")

    def push(self, header: UpdateHeader, payload: bytes | memoryview, *,
             wire_bytes: int = 0) -> PushResult:
        """One update through the push pipeline on this thread, with the in-process tier
        (:meth:`murmura.server.pipeline.PushPipeline.push`); refuses with a ServiceError."""
        return self.pipeline.push(header, payload, wire_bytes=wire_bytes)

    @property
    def pipeline(self) -> PushPipeline:
        """The push pipeline of callers without a server of their own (the simulator, the
        in-memory transport, tests): the steps every push takes, decoding in-process."""
        if self._pipeline is None:
            from murmura.server.pipeline import PushPipeline
            from murmura.server.tier import Tier

            self._pipeline = PushPipeline(cast("AggregatorCore", self),
                                          Tier(self.config.tier, self.decoder))
        return self._pipeline

    def precheck(self, header: UpdateHeader) -> ClientRecord:
        """Checks that need only the header, so a transport can refuse before the payload.

        A refusal here is counted in ``traffic.refused`` like one from :meth:`push`.
        """
        try:
            return self._precheck(header)
        except ServiceError as exc:
            self.telemetry.refused(header.session, exc)
            self.count_refusal(exc)
            raise

    def _precheck(self, header: UpdateHeader,
                  rec: ClientRecord | None = None) -> ClientRecord:
        # A transport prechecks a header and then pushes that same (frozen) header object:
        # its fields are validated once (a tenth of a simulated round went to validating
        # each header twice). A header not among the last ones validated is checked again.
        valid = self._valid_headers
        if valid.get(id(header)) is not header:
            check_header(header)
            valid[id(header)] = header
            if len(valid) > VALID_HEADERS:
                valid.popitem(last=False)
        if rec is None:
            rec = self._record(header.session)
        if header.payload_bytes > self.config.security.max_payload_bytes:
            raise ResourceExhausted(f"payload of {header.payload_bytes} bytes exceeds the limit "
                                    f"of {self.config.security.max_payload_bytes}")
        if self.config.security.require_identity and len(header.signature) != SIGNATURE_BYTES:
            if not header.signature:
                raise PermissionDenied("this server counts only signed updates; the update has "
                                       "no signature")
            raise InvalidArgument(f"an update signature has {SIGNATURE_BYTES} bytes, got "
                                  f"{len(header.signature)}")
        if header.spec_fingerprint != self.fingerprint:
            # No retry can fix this: the session ends with the refusal, so a sync round does
            # not wait for a client that will never send an update it can take.
            self._end_session(rec.session, rec)
            self._changed()
            raise FailedPrecondition(f"update was trained for model spec "
                                     f"{quote(header.spec_fingerprint)}; this server's is "
                                     f"{self.fingerprint}; the session is closed")
        if header.base_version > self.version:
            raise InvalidArgument(f"base version {header.base_version} is in the future "
                                  f"(global version is {self.version})")
        if header.codec == PARTIAL_CODEC:
            self._check_leaf(rec)
        if (rec.client_id, header.update_id) not in self._seen:
            self.policy.check_staleness(self.staleness_of(header.base_version))
        return rec

    def staleness_of(self, base_version: int) -> int:
        """How many versions an update trained on ``base_version`` is behind the model its
        aggregate will step: the installed version plus those being published. A version in
        the publisher's queue is not installed yet, but the next aggregate steps *its* model;
        counting only installed versions gave updates that arrive while the publisher lags (a
        loaded machine, many clients) the full weight of fresh ones, so several versions in a
        row stepped the same old deltas (async runs that swung by 0.4 in accuracy)."""
        return self.version + self.publishing - base_version

    def begin_push(self, header: UpdateHeader, payload_bytes: int, *, wire_bytes: int = 0,
                   prechecked: ClientRecord | None = None
                   ) -> tuple[ClientRecord, PushResult | None]:
        """Everything checkable before decoding. Returns the client's record and, for a retried
        update that was already counted, the answer to give (the payload need not be decoded).

        ``prechecked`` is the record :meth:`precheck` returned for this header with nothing
        run on the core since (the synchronous driver): its checks are not repeated.

        Unless it refuses or answers a duplicate, the caller must end the push with
        :meth:`finish_push` or :meth:`abort_push`.
        """
        self.traffic.bytes_up += wire_bytes  # refused updates crossed the wire too
        self.telemetry.received(header.codec, wire_bytes)
        try:
            if self.store_error is not None:
                raise Unavailable("the aggregator cannot write its durable state; retry later")
            rec = self._record(header.session) if prechecked is None else prechecked
            wait = self._push_limit.allow(rec.client_id, self.clock())
            if wait:
                raise ResourceExhausted(f"client {quote(rec.client_id)} pushes too often (at "
                                        f"most {self.config.security.push_per_s:g} per second)",
                                        retry_after_s=wait)
            key = (rec.client_id, header.update_id)
            if key in self._seen:
                # A retry while the first push still waits for its commit: the duplicate is
                # answered once the update is durable too (the transport awaits this).
                self.last_durable = self._committing.get(key)
                return rec, PushResult(duplicate=True, version=self.version,
                                       staleness=self._seen[key])
            if key in self._inflight:
                raise Aborted(f"update {header.update_id!r} is already being taken in; retry "
                              f"to learn its outcome")
            if prechecked is None:
                rec = self._precheck(header, rec)
            if self.finished:
                raise FailedPrecondition(self._finished_message(), reason="run over")
            if header.payload_bytes != payload_bytes:
                raise InvalidArgument(f"header announces {header.payload_bytes} payload bytes, "
                                      f"{payload_bytes} arrived")
        except ServiceError as exc:
            self.telemetry.refused(header.session, exc)
            self.count_refusal(exc)
            raise
        self._inflight.add(key)
        return rec, None

    def reference_for(self, header: UpdateHeader) -> FlatVector | None:
        """The version a reference-needing codec (seed replay) decodes against, if kept."""
        if not self.decoder.needs_reference(header.codec):
            return None
        return self._history.get(header.base_version)

    def abort_push(self, header: UpdateHeader, exc: BaseException) -> None:
        """Decoding failed: count the refusal and forget the update (a retry may come)."""
        self._inflight.discard(self._key(header))
        self.telemetry.refused(header.session, exc)
        if isinstance(exc, ServiceError):
            self.count_refusal(exc)

    def _key(self, header: UpdateHeader) -> tuple[str, str]:
        rec = self.sessions.get(header.session)
        return (rec.client_id if rec else "", header.update_id)

    def finish_push(self, header: UpdateHeader, decoded: Decoded, *,
                    release: Callable[[], None] | None = None,
                    spooled: SpoolRef | None = None,
                    rec: ClientRecord | None = None) -> PushResult:
        """Hand a decoded update to the policy. ``release`` is called once nothing needs the
        decoded values any more (after the fold), also when the update is refused.

        With durable state, ``spooled`` is where the payload lies in the spool; the update is
        acknowledged only once :attr:`last_durable` is done (its pending row and counted id
        are committed before any version that includes it: the store runs in order).
        ``rec`` is the client's record when the caller found it with nothing run since
        (:meth:`push`); otherwise it is looked up again.
        """
        key = self._key(header) if rec is None else (rec.client_id, header.update_id)
        self._inflight.discard(key)
        digest = decoded.payload_sha256
        self.last_durable = None
        taken = False
        try:
            if rec is None:  # decoded elsewhere: the client may have left meanwhile
                rec = self._record(header.session)
            if self.config.security.require_identity:
                self._check_signature(rec, header, digest)
            if self.finished:
                raise FailedPrecondition(self._finished_message(), reason="run over")
            staleness = self.staleness_of(header.base_version)  # versions may have been made
            self.policy.check_staleness(staleness)
            if decoded.is_partial:
                self._check_partial(decoded)
            mass = decoded.max_abs * (1.0 if decoded.is_partial else float(header.num_examples))
            if self.fold_mass + mass > self.fold_limit:
                raise InvalidArgument(
                    f"update too large to aggregate: max |value| x num_examples = {mass:.3g} "
                    f"would take this version's aggregate past {self.fold_limit:.3g} (its "
                    f"range, with {self.fold_mass:.3g} already taken)")
            if self.store is not None and spooled is None:
                raise Unavailable("the update's payload was not spooled; retry")
            # counted before the policy may publish a version with it (which resets the mass)
            self.traffic.updates += 1
            self.fold_mass += mass
            seq = 0
            if self.store is not None:
                assert spooled is not None
                self._seq += 1
                seq = self._seq
                self._batch.append(seq)  # before accept: it may publish the version with it
                fut = self._durable(RecordPush(seq, rec.client_id, header.update_id,
                                               _header_record(header), staleness, spooled))
                self._committing[key] = fut
                fut.add_done_callback(lambda _: self._committing.pop(key, None))
            report = report_from_metrics(rec.client_id, header.metrics)
            if report is not None:  # before accept: it may publish the version with it
                self.client_evals.add(report)
            trained = (self.client_train.add(header.metrics, header.num_examples)
                       if self.client_train is not None else None)  # server/client_train.py
            decoded.base_version = header.base_version
            decoded.spooled = spooled  # a version folded in workers can be rebuilt from it
            decoded.codec = header.codec
            decoded.examples = float(header.num_examples)
            try:
                self.policy.accept(rec, header, decoded, staleness, release)
                taken = True
            except BaseException:
                if report is not None:
                    self.client_evals.discard(report)
                if trained is not None:
                    self.client_train.discard(trained)
                self.traffic.updates -= 1
                self.fold_mass -= mass
                if seq:
                    self._batch.remove(seq)
                    self._committing.pop(key, None)
                    self._durable(DropPush(seq, rec.client_id, header.update_id))
                    self.last_durable = None
                raise
        except ServiceError as exc:
            self.telemetry.refused(header.session, exc)
            self.count_refusal(exc)
            raise
        finally:
            if not taken and release is not None:
                release()
        self._seen[key] = staleness
        if digest is not None:
            self._counted[digest] = rec.client_id
        rec.updates += 1
        self.telemetry.accepted(rec, staleness)
        self._changed()
        return PushResult(duplicate=False, version=self.version, staleness=staleness)
