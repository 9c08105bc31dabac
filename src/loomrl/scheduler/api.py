"""The bodies the daemon's API takes, one typed model per route, checked before anything
reaches the scheduler: unknown keys, wrong types, non-finite numbers (``NaN``,
``Infinity``: Python's JSON reads them) and numbers or names out of bounds are refused
with a ``BadRequest`` (HTTP 400) that names the field, the bound and the value given.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from loomrl.scheduler.model import (
    MAX_DEVICES,
    MAX_DURATION_S,
    MAX_HEARTBEAT_TIMEOUT_S,
    MAX_NAME_CHARS,
    MAX_POLL_S,
    MAX_PRIORITY,
    MAX_WEIGHT,
    MIN_HEARTBEAT_TIMEOUT_S,
    MIN_WEIGHT,
    BadRequest,
)

DEFAULT_POLL_S = 20.0
SECRET_FIELDS = ("token", "secret")  # never echoed in an error

Name = Annotated[
    str, StringConstraints(min_length=1, max_length=MAX_NAME_CHARS, pattern=r"^[^\x00-\x1f\x7f]+$")
]
Phase = Annotated[str, StringConstraints(max_length=MAX_NAME_CHARS, pattern=r"^[^\x00-\x1f\x7f]*$")]
Id = Annotated[str, StringConstraints(min_length=1, max_length=64)]
Secret = Annotated[str, StringConstraints(max_length=256)]
Seconds = Annotated[float, Field(ge=0.0, le=MAX_DURATION_S)]


class Body(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)


class Register(Body):
    name: Name
    token: Secret | None = Field(None, description="The daemon's token (its token file).")
    priority: int = Field(0, ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    weight: float = Field(1.0, ge=MIN_WEIGHT, le=MAX_WEIGHT)
    heartbeat_timeout_s: float = Field(10.0, ge=MIN_HEARTBEAT_TIMEOUT_S, le=MAX_HEARTBEAT_TIMEOUT_S)


class JobCall(Body):
    job_id: Id
    secret: Secret | None = Field(None, description="The job's secret, from its registration.")


class Heartbeat(JobCall):
    pass


class Unregister(JobCall):
    pass


class Acquire(JobCall):
    devices: list[Name] = Field(min_length=1, max_length=MAX_DEVICES)
    phase: Phase = ""
    expected_s: Seconds | None = None
    timeout_s: Annotated[float, Field(gt=0.0, le=MAX_DURATION_S)] | None = None
    poll_s: float = Field(DEFAULT_POLL_S, ge=0.0, le=MAX_POLL_S)


class Wait(JobCall):
    request_id: Id
    poll_s: float = Field(DEFAULT_POLL_S, ge=0.0, le=MAX_POLL_S)


class Release(JobCall):
    lease_id: Id
    restore_s: Seconds = 0.0
    expected_idle_s: Seconds | None = None


class Evicted(JobCall):
    devices: list[Name] = Field(max_length=MAX_DEVICES)
    offload_s: Seconds = 0.0


class Boundary(JobCall):
    lease_id: Id


class Cancel(JobCall):
    request_id: Id


ROUTES: dict[str, type[Body]] = {
    "/v1/register": Register,
    "/v1/heartbeat": Heartbeat,
    "/v1/acquire": Acquire,
    "/v1/wait": Wait,
    "/v1/release": Release,
    "/v1/evicted": Evicted,
    "/v1/boundary": Boundary,
    "/v1/cancel": Cancel,
    "/v1/unregister": Unregister,
}


def parse(route: str, body: Any) -> Body:
    """``body`` (decoded JSON) as the route's model, or ``BadRequest`` saying what is wrong.
    Raises ``KeyError(route)`` for a route that does not exist."""
    model = ROUTES[route]
    if not isinstance(body, dict):
        raise BadRequest(f"{route}: the body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as err:
        raise BadRequest(f"{route}: " + "; ".join(_problem(e) for e in err.errors()[:5])) from None


def _problem(error: Any) -> str:
    where = ".".join(str(part) for part in error["loc"]) or "body"
    if error["type"] == "missing" or (error["loc"] and error["loc"][0] in SECRET_FIELDS):
        return f"{where}: {error['msg']}"
    given = repr(error.get("input"))
    given = given if len(given) <= 60 else given[:57] + "..."
    return f"{where}: {error['msg']} (got {given})"
