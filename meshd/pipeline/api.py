"""What the orchestrator offers its callers (the HTTP API), without its machinery.

The dashboard serves ``/api/generate``, ``/v1/completions`` and
``/v1/chat/completions`` through :class:`Generator`; it never imports the
pipeline's services.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Protocol


class PipelineError(Exception):
    """A request failed; the message names the stage and what went wrong."""


class StageLost(PipelineError):
    """A stage died mid-request; ``lost`` reads ``stage-2 (peer 2b91108e dead)``.  Stages
    restart within seconds and replicas take over at once, so the 503 says to retry after
    ``retry_after`` seconds."""

    def __init__(self, lost: str, retry_after: int = 1) -> None:
        super().__init__(f"lost: {lost}")
        self.lost = lost
        self.retry_after = retry_after


class NotReady(PipelineError):
    """Some pipeline names do not resolve; ``missing`` lists them.  Mostly a stage on its
    way (started, or started again, and not yet known to the orchestrator), so the 503
    says to retry after ``retry_after`` seconds."""

    def __init__(self, missing: list[str], retry_after: int = 1, reasons: dict[str, str] | None = None
                 ) -> None:
        reasons = reasons or {}
        super().__init__("pipeline not ready: " + ", ".join(
            f"{n} does not resolve ({reasons.get(n) or _serving(n)})" for n in missing))
        self.missing = missing
        self.retry_after = retry_after


def _serving(name: str) -> str:
    """What a missing pipeline name means in the stages' own names."""
    if name == "pp-entry":
        return "no live node takes requests as stage-0"
    stage = name.removeprefix("pp-")
    return f"no live node serves {stage}" if stage != name else "no live node holds it"


class Busy(PipelineError):
    """Every slot is taken and the queue is full: retry after ``retry_after`` seconds (503
    with Retry-After)."""

    def __init__(self, message: str, retry_after: int = 1) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class Generator(Protocol):
    """The orchestrator, as the HTTP API calls it."""

    recent_traces: Iterable[dict[str, Any]]  # each request's last traces, newest last
    recent_failovers: Iterable[dict[str, Any]]  # {request, stage, from, to, ms, why}, newest last
    recently_ended: Iterable[dict[str, Any]]  # as ``active`` lists a request, for ended ones, newest last
    model_name: str  # what /v1/models calls the model: its checkpoint directory's name
    created: int  # when this orchestrator started serving it (Unix seconds), for /v1/models

    def active(self) -> list[dict[str, Any]]:
        """Running requests: ``{request, route: {stage-K: prefix}, tokens, failovers}``."""
        ...

    def missing(self) -> list[str]:
        """Pipeline names that do not resolve now."""
        ...

    def not_ready(self) -> NotReady | None:
        """What a new request gets now if a pipeline name has no usable owner (each named with
        why its owners cannot serve), else None."""
        ...

    def layer_split(self) -> dict[str, range]:
        """The layers each stage holds: ``{"stage-K": range}``, in stage order."""
        ...

    def busy(self) -> Busy | None:
        """What a new request gets now if the queue is full (counted as refused busy), else None."""
        ...

    def load(self) -> dict[str, int | float]:
        """Requests running and waiting now, the limits, the KV cache held at the largest stage
        (MB), and the requests refused as busy so far (``refused_busy``)."""
        ...

    def decode(self, tokens: list[int]) -> str:
        """Token ids to text, with the model's tokenizer."""
        ...

    def chat_prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        """A conversation (``{role, content}`` dicts, content a string) as prompt token ids,
        through the model's chat template; raises ValueError (``ChatTemplateError``, whose
        ``param`` names the field, if one) when the template cannot write it."""
        ...

    async def generate(self, prompt: str | list[int], max_tokens: int | None, temperature: float = 0.0,
                       top_k: int = 0, seed: int = 0, *, top_p: float = 1.0, stop: Sequence[str] = (),
                       on_token: Callable[[int], Awaitable[None]] | None = None,
                       request_id: str | None = None) -> dict[str, Any]:
        """Generate from text (BOS first) or token ids (as they are); raises PipelineError (or
        ValueError for a prompt the model cannot take).  ``max_tokens`` None: what the context
        holds.  ``stop``: the text ends before the first of these, and generation with it.
        The result has ``tokens``, ``text``, ``prompt_tokens``, ``finish_reason`` ("eos",
        "length" or "stop"), ``timings``."""
        ...
