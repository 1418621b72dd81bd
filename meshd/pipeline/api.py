"""What the orchestrator offers its callers (the HTTP API), without its machinery.

The dashboard serves ``/api/generate`` and ``/v1/completions`` through
:class:`Generator`; it never imports the pipeline's services.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable
from typing import Any, Protocol


class PipelineError(Exception):
    """A request failed; the message names the stage and what went wrong."""


class StageLost(PipelineError):
    """A stage died mid-request; ``lost`` reads ``stage-2 (peer 2b91108e dead)``."""

    def __init__(self, lost: str) -> None:
        super().__init__(f"lost: {lost}")
        self.lost = lost


class NotReady(PipelineError):
    """Some pipeline names do not resolve; ``missing`` lists them."""

    def __init__(self, missing: list[str]) -> None:
        super().__init__("pipeline not ready: " + ", ".join(f"{n} does not resolve" for n in missing))
        self.missing = missing


class Generator(Protocol):
    """The orchestrator, as the HTTP API calls it."""

    recent_traces: Iterable[dict[str, Any]]  # each request's last traces, newest last
    recent_failovers: Iterable[dict[str, Any]]  # {request, stage, from, to, ms, why}, newest last
    model_name: str  # what /v1/models calls the model: its checkpoint directory's name
    created: int  # when this orchestrator started serving it (Unix seconds), for /v1/models

    def active(self) -> list[dict[str, Any]]:
        """Running requests: ``{request, route: {stage-K: prefix}, tokens, failovers}``."""
        ...

    def missing(self) -> list[str]:
        """Pipeline names that do not resolve now."""
        ...

    def decode(self, tokens: list[int]) -> str:
        """Token ids to text, with the model's tokenizer."""
        ...

    async def generate(self, prompt: str, max_tokens: int, temperature: float = 0.0, top_k: int = 0,
                       seed: int = 0, *, on_token: Callable[[int], Awaitable[None]] | None = None
                       ) -> dict[str, Any]:
        """Generate; raises PipelineError (or ValueError for a prompt the model cannot take).
        The result has ``tokens``, ``text``, ``prompt_tokens``, ``finish_reason``, ``timings``."""
        ...
