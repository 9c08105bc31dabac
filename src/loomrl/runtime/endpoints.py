"""Endpoints: the methods of an executor that a handle may call.

An interface (``Generator``, ``TrainerEndpoints``) marks its methods with ``@endpoint``; a
runtime starts an executor against its interface and gives back a handle whose attributes
are exactly those endpoints, as ``Endpoint`` objects with call variants:

- ``await trainer.train_step(groups)`` (or ``trainer.train_step.call(groups)``): the result;
- ``await generator.generate.call(requests, then=post)``: ``post(result)``, run where the
  call ended, off the caller's loop (see ``Endpoint.call``);
- over interchangeable executors (``loomrl.runtime.replicas``):
  ``scorers.score.route(...)`` on the least busy, ``generators.apply_weights.fanout(...)``
  on all of them.

Arguments are checked against the signature before anything leaves the caller. The executor
a runtime builds must have every endpoint, or the start fails with the names it lacks (a
misspelt method fails at start-up, on every runtime, not deep in a job); a handle asked for
a name its interface does not declare fails at once.

``@endpoint(concurrent=True)`` says that calls of that method may overlap each other and
other calls (an engine that batches continuously); by default an executor runs one call at
a time, in order. An implementation may override the flag by marking its own method.
"""

from __future__ import annotations

import difflib
import functools
import inspect
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])
_MARK = "__loomrl_endpoint__"
THEN = "then"  # the keyword of a call's post-processing (no endpoint may take a parameter of that name)

# How an endpoint's owner sends a call: ``send(endpoint name, args, kwargs, then)``, to await.
Send = Callable[[str, tuple, dict, Callable[[Any], Any] | None], Awaitable[Any]]


@dataclass(frozen=True)
class EndpointSpec:
    name: str
    concurrent: bool = False
    signature: inspect.Signature | None = None


class MissingEndpointError(TypeError):
    """An executor lacks a method its interface declares (or a handle was asked for one
    that the interface does not declare)."""


def endpoint(fn: F | None = None, *, concurrent: bool = False):
    """Mark ``fn`` as an endpoint; ``concurrent=True``: its calls may overlap."""

    def mark(f: F) -> F:
        setattr(f, _MARK, EndpointSpec(f.__name__, concurrent, inspect.signature(f)))
        return f

    return mark(fn) if fn is not None else mark


def _spec_of(attr: Any) -> EndpointSpec | None:
    return getattr(attr, _MARK, None)


@functools.cache  # looked up once per class: every executor call checks its method against them
def endpoints_of(interface: type) -> Mapping[str, EndpointSpec]:
    """The endpoints ``interface`` declares, by name."""
    specs = {}
    for name in dir(interface):
        spec = _spec_of(getattr(interface, name, None))
        if spec is not None:
            specs[name] = spec
    if not specs:
        raise TypeError(f"{interface.__name__} declares no @endpoint methods")
    return MappingProxyType(specs)


def _near(name: str, names: list[str]) -> str:
    close = difflib.get_close_matches(name, names, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_implements(obj: Any, interface: type) -> dict[str, bool]:
    """Every endpoint of ``interface`` is a method of ``obj``; returns ``{name: concurrent}``
    as ``obj`` declares it (its own ``@endpoint`` mark, else the interface's)."""
    specs = endpoints_of(interface)
    public = [n for n in dir(obj) if not n.startswith("_") and callable(getattr(obj, n, None))]
    missing = [name for name in specs if not callable(getattr(obj, name, None))]
    if missing:
        hints = ", ".join(f"{name!r}{_near(name, public)}" for name in missing)
        raise MissingEndpointError(
            f"{type(obj).__name__} does not implement {interface.__name__}: no method {hints}"
        )
    concurrency = {}
    for name, spec in specs.items():
        own = _spec_of(getattr(type(obj), name, None))
        concurrency[name] = (own or spec).concurrent
    return concurrency


def bind_arguments(interface: type, name: str, args: tuple, kwargs: dict) -> None:
    """Raise ``TypeError`` at the caller when ``args`` do not fit endpoint ``name``."""
    # whether arguments bind depends on this alone
    shape = (interface, name, len(args), tuple(kwargs))
    if shape in _BOUND:
        return
    spec = endpoints_of(interface)[name]
    if spec.signature is not None:
        try:
            spec.signature.bind(None, *args, **kwargs)  # None stands for self
        except TypeError as err:
            raise TypeError(f"{interface.__name__}.{name}{spec.signature}: {err}") from None
    if len(_BOUND) < 4096:
        _BOUND.add(shape)


# call shapes that bound once (an endpoint is called the same way every step)
_BOUND: set[tuple] = set()


def unknown_endpoint(interface: type, name: str) -> MissingEndpointError:
    names = sorted(endpoints_of(interface))
    return MissingEndpointError(
        f"{interface.__name__} has no endpoint {name!r}{_near(name, names)}; its endpoints: {', '.join(names)}"
    )


class Endpoint:
    """One endpoint of one executor, as its handle (or ``Supervised`` slot) holds it:
    ``handle.generate``. Calling it is ``call`` without ``then``."""

    __slots__ = ("name", "_send")

    def __init__(self, name: str, send: Send) -> None:
        self.name, self._send = name, send

    def __call__(self, *args: Any, **kwargs: Any) -> Awaitable[Any]:
        return self._send(self.name, args, kwargs, None)

    def call(
        self, *args: Any, then: Callable[[Any], Any] | None = None, **kwargs: Any
    ) -> Awaitable[Any]:
        """The call, to await: its result, or with ``then`` what ``then(result)`` returns,
        run where the call ended, before the caller's loop hears of it (on ``local`` the
        executor's thread, on ``process`` the handle's transport thread, where the result was
        unpickled; on a runtime with no such thread, on the loop), so that what the caller
        makes of a result costs its loop nothing. ``then`` must not touch what the loop owns
        (it may run alongside it); what it raises is the call's error."""
        return self._send(self.name, args, kwargs, then)

    def __repr__(self) -> str:
        return f"<endpoint {self.name}>"


def check_no_then_parameter(interface: type) -> None:
    """Refuse an interface whose endpoint takes a ``then`` parameter: ``Endpoint.call``
    keeps that keyword for its post-processing."""
    for name, spec in endpoints_of(interface).items():
        if spec.signature is not None and THEN in spec.signature.parameters:
            raise TypeError(
                f"endpoint {interface.__name__}.{name} takes a parameter {THEN!r}, the keyword "
                f"Endpoint.call keeps for post-processing; rename it"
            )
