"""bench/prefill.py's comparison: stage processes that run a prompt as one pass in a worker
thread, not chunk by chunk.  On PYTHONPATH only for that mesh."""

import trio

from meshd.pipeline import model, stage


async def _one_pass(self, hidden, job, pos):
    return await trio.to_thread.run_sync(self.model.forward, hidden, job.cache, pos)


model.PREFILL_CHUNK = 1 << 30
stage.StageService._prefill = _one_pass
