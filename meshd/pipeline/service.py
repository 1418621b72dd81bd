"""The pipeline's services on the mesh: what the daemon starts for a node's role.

``StageService`` (meshd.pipeline.stage) serves one stage's layers;
``Orchestrator`` (meshd.pipeline.orchestrator) takes requests, picks their
routes and moves them to replicas when a node fails.  Both move messages over
the node's data channel (meshd.pipeline.app), through :class:`meshd.mesh.Mesh`.
"""

from __future__ import annotations

from .api import NotReady, PipelineError, StageLost
from .app import resolve
from .orchestrator import Orchestrator, summarize
from .stage import StageService

__all__ = ["NotReady", "Orchestrator", "PipelineError", "StageLost", "StageService", "resolve", "summarize"]
