"""The progress record each peer publishes into the DHT, and the validators that protect it.

hivemind + pydantic only (no VISSL), because both the publishing hook (in every trainer) and ``run_monitor.py``
import it. Every DHT of a run adds the same validators, ``dht.add_validators(metrics_validators(run_id))``: a
record is validated by each peer that stores it and again by the peer that reads it, so

- ``RSASignatureValidator``: the subkey of a record is its owner's RSA public key and the value must carry the
  owner's signature, so no peer can overwrite (or fake) another peer's record;
- ``SchemaValidator``: values under ``<run_id>_metrics`` must be a :class:`PeerMetrics` with exact types, so a
  buggy or hostile peer cannot put garbage in the monitor's table;
- with a swarm secret, ``decentralized_sgd.secret.SwarmSecretValidator``: every record carries a keyed hash, so
  only peers holding the secret can write records at all (and only they can read them: the monitor needs it too).
"""

from __future__ import annotations

import math
from typing import Any

import pydantic.v1 as pydantic  # hivemind's SchemaValidator is written against pydantic's v1 API
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.dht.schema import BytesWithPublicKey, SchemaValidator
from hivemind.dht.validation import RecordValidatorBase
from hivemind.utils.crypto import RSAPrivateKey

from decentralized_sgd.secret import SwarmSecret, SwarmSecretValidator

ADDED_LATER = ("averager_failures", "no_group_s")  # PeerMetrics fields that records of older peers lack


class PeerMetrics(pydantic.BaseModel):
    """One peer's latest progress. Strict types: hivemind rejects any record that pydantic would have to convert."""

    step: pydantic.conint(ge=0, strict=True)
    samples_per_s: pydantic.confloat(ge=0.0, strict=True)
    loss: pydantic.StrictFloat | None  # None when not finite (NaN != NaN would fail hivemind's equality check)
    group_size: pydantic.conint(ge=1, strict=True) | None  # of the last applied averaging round; None: none yet
    staleness_steps: pydantic.conint(ge=0, strict=True) | None
    rounds_ok: pydantic.conint(ge=0, strict=True)
    rounds_failed: pydantic.conint(ge=0, strict=True)
    time: pydantic.StrictFloat  # the publisher's wall clock (time.time()) when it made the record
    peer_id: pydantic.constr(strict=True, max_length=128)
    # added later, with a default (see ADDED_LATER): records of peers that run an older version stay valid
    averager_failures: pydantic.conint(ge=0, strict=True) = 0  # times the averager was found dead or unresponsive
    no_group_s: pydantic.confloat(ge=0.0, strict=True) = 0.0  # seconds since its last applied round (or its start)

    def dict(self, **kwargs: Any) -> dict[str, Any]:
        """Leaves out a field of ADDED_LATER that the record does not hold: hivemind's SchemaValidator rejects a
        record that differs from its parsed form, so the default filled in would make older peers' records invalid.
        Every other field stays in (a record without ``loss`` still fails: parsed, it has ``loss: None``)."""
        missing = {name for name in ADDED_LATER if name not in self.__fields_set__}
        return super().dict(**{**kwargs, "exclude": (kwargs.get("exclude") or set()) | missing})

    @classmethod
    def complete(cls, value: Any) -> dict[str, Any]:
        """The record with every field, defaults filled in; pydantic.ValidationError if it breaks the schema."""
        parsed = cls.parse_obj(value)
        return {name: getattr(parsed, name) for name in cls.__fields__}


class MetricsSchema(pydantic.BaseModel):
    """The DHT key ``<run_id>_metrics``: a dictionary {owner's public key: that owner's PeerMetrics}."""

    metrics: dict[BytesWithPublicKey, PeerMetrics]


def metrics_key(run_id: str) -> str:
    return f"{run_id}_metrics"


def metrics_validators(
    run_id: str, private_key: RSAPrivateKey | None = None, secret: SwarmSecret | None = None
) -> list[RecordValidatorBase]:
    """Validators for the metrics key of ``run_id``; add them to every DHT of the run, the monitor's included.
    ``secret``: the swarm's (``swarm.start_dht`` adds its validator already; adding it again is harmless).

    ``private_key`` defaults to hivemind's process-wide key, the one :func:`owner_subkey` names: the DHT signs a
    record only when its subkey holds the public key of the signing validator it was given. Adding these twice to
    one DHT is harmless (hivemind merges a second RSASignatureValidator away and a second schema is the same).
    """
    validators: list[RecordValidatorBase] = [
        SchemaValidator(MetricsSchema, prefix=run_id),
        RSASignatureValidator(private_key),
    ]
    if secret is not None:
        validators.append(SwarmSecretValidator(secret))
    return validators


def owner_subkey(private_key: RSAPrivateKey | None = None) -> bytes:
    """The subkey under which this process publishes: its public key, as RSASignatureValidator expects it."""
    return RSASignatureValidator(private_key).local_public_key


def make_record(
    *,
    step: int,
    samples_per_s: float,
    loss: float | None,
    group_size: int | None,
    staleness_steps: int | None,
    rounds_ok: int,
    rounds_failed: int,
    time: float,
    peer_id: str,
    averager_failures: int = 0,
    no_group_s: float = 0.0,
) -> dict[str, Any]:
    """A record that passes the schema: numbers coerced to the exact types, a non-finite loss as None."""
    finite_loss = loss is not None and math.isfinite(float(loss))
    return {
        "step": max(0, int(step)),
        "samples_per_s": max(0.0, float(samples_per_s)) if math.isfinite(float(samples_per_s)) else 0.0,
        "loss": float(loss) if finite_loss else None,
        "group_size": int(group_size) if group_size is not None and group_size >= 1 else None,
        "staleness_steps": max(0, int(staleness_steps)) if staleness_steps is not None else None,
        "rounds_ok": max(0, int(rounds_ok)),
        "rounds_failed": max(0, int(rounds_failed)),
        "time": float(time),
        "peer_id": str(peer_id)[:128],
        "averager_failures": max(0, int(averager_failures)),
        "no_group_s": round(max(0.0, float(no_group_s)), 1) if math.isfinite(float(no_group_s)) else 0.0,
    }


def fetch_metrics(dht: Any, run_id: str, timeout: float = 30.0) -> dict[bytes, dict[str, Any]]:
    """{owner subkey: record} of every peer with a live record; TimeoutError if the DHT does not answer in time.

    ``dht`` must have :func:`metrics_validators`: they strip the signatures, and hivemind 1.1 cannot decode a signed
    value without them (its ``get`` then never returns). The DHT already dropped records that failed the
    validators; parsing again here guards against a DHT that was started without the schema.
    """
    found = dht.get(metrics_key(run_id), latest=True, return_future=True).result(timeout=timeout)
    if found is None or not isinstance(found.value, dict):
        return {}
    records = {}
    for subkey, entry in found.value.items():
        try:
            records[subkey] = PeerMetrics.complete(entry.value)
        except (pydantic.ValidationError, AttributeError, TypeError):
            continue
    return records
