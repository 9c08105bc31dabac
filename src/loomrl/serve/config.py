"""``[serve]``: the job's OpenAI-compatible endpoint (``loomrl.serve``).

Imported with the job's config; nothing else of ``loomrl.serve`` (FastAPI, uvicorn) is,
unless the endpoint runs (``serve.enabled``, or ``task.agent``)."""

from __future__ import annotations

import ipaddress

from pydantic import Field, model_validator

from loomrl.config_base import Section


def is_loopback(host: str) -> bool:
    """Whether ``host`` names this machine only ('localhost', 127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ServeConfig(Section):
    enabled: bool = Field(
        False,
        description="Serve the policy on an OpenAI-compatible endpoint for the whole run "
        "(/v1/models, /v1/completions, /v1/chat/completions, /v1/episodes); a job with "
        "task.agent serves it whatever this says.",
    )
    host: str = Field(
        "127.0.0.1",
        description="Address the endpoint listens on; loopback only unless allow_remote.",
    )
    port: int = Field(0, ge=0, le=65535, description="Port; 0: a free one, chosen at start.")
    allow_remote: bool = Field(
        False,
        description="Allow a host that is not loopback (every request still needs the "
        "job's bearer token; put TLS in front of it).",
    )
    model_name: str | None = Field(
        None,
        description="The model id /v1/models lists and requests name; default: the job's name.",
    )
    batch_window_ms: float = Field(
        5.0,
        ge=0,
        le=10_000,
        description="Requests arriving within this window go to a generator as one generate call.",
    )
    max_batch: int = Field(
        64, gt=0, description="A generate call takes at most this many requests."
    )
    max_tokens: int | None = Field(
        None,
        gt=0,
        description="Tokens a request may ask for at most (max_tokens); default: "
        "generation.max_new_tokens, also the default of a request that names none.",
    )
    max_body_bytes: int = Field(
        4 << 20, gt=0, description="A request body over this is refused (413)."
    )
    tool_parser: str | None = Field(
        None,
        description="How a chat completion's text becomes tool_calls: a parser name of "
        "loomrl.envs.tool_parsers ('hermes', 'llama3_json', 'mistral'), or 'module:function' "
        "returning (content, tool_calls, errors); None: no tool_calls, the text is the content.",
    )
    chat_template: str | None = Field(
        None,
        description="A Jinja chat template (its text) that renders a chat request's messages "
        "(and tools); None: the tokenizer's own, or, for a tokenizer without one, one "
        "'role: content' line per message.",
    )
    episode_timeout_s: float = Field(
        300.0,
        gt=0,
        description="An agent function (task.agent) running longer fails its episode (timeout).",
    )
    episode_deadline_s: float = Field(
        600.0,
        gt=0,
        description="An episode opened by an external harness (POST /v1/episodes) and not "
        "closed within this is closed as failed (so it cannot stall a step).",
    )

    @model_validator(mode="after")
    def _loopback_unless_allowed(self) -> ServeConfig:
        if not self.allow_remote and not is_loopback(self.host):
            raise ValueError(
                f"serve.host={self.host!r} is not a loopback address; set serve.allow_remote=true "
                "to serve beyond this machine (every request still needs the job's token)"
            )
        return self
