"""meshd's numpy decoder against Hugging Face ``transformers``, a reference no one here wrote.

For each family (meshd/testing/reference.py), a small random model is built with
transformers' own classes and ``save_pretrained``; meshd loads that directory and
must give, at every greedy step, logits within 1e-4 of the reference's largest
|logit| and the same tokens: in one process, and over a 3-stage mesh on loopback.
The Mistral and Qwen2 models have an attention window of 8 and the sequences run
past 24 positions, so the window is crossed in prefill and in decode.

Needs the ``reference`` extra (torch, transformers): `make test` installs it.
"""

from __future__ import annotations

import pytest
import trio

MISSING = "the reference extra (pip install -e '.[reference]') is not installed"
pytest.importorskip("torch", reason=MISSING)
pytest.importorskip("transformers", reason=MISSING)

from meshd.pipeline.config import LlamaConfig  # noqa: E402
from meshd.pipeline.generate import generate, prompt_ids  # noqa: E402
from meshd.pipeline.model import StageModel  # noqa: E402
from meshd.pipeline.tokenizer import load_tokenizer  # noqa: E402
from meshd.testing import reference  # noqa: E402
from meshd.testing.inprocess import start_pipeline  # noqa: E402

PROMPT = "Once upon a time"
STEPS = 12
TOLERANCE = 1e-4  # of the reference's largest |logit|
# Stored as Llama 3.2 ships: bfloat16, in shards.  The rest float32, one file.
STORED = {"llama3.2": ("bfloat16", "40KB"), "tinyllama": ("float16", None)}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Family name -> (checkpoint dir, reference tokens, reference logits)."""
    root = tmp_path_factory.mktemp("reference")
    out = {}
    for family in reference.FAMILIES:
        path = root / family.name
        dtype, shard = STORED.get(family.name, ("float32", None))
        reference.build(family, path, dtype=dtype, max_shard_size=shard)
        config = LlamaConfig.load(path)
        ids = prompt_ids(load_tokenizer(path, config.bos_token_id, config.eos_token_ids), PROMPT)
        tokens, logits = reference.greedy_logits(reference.load(path), ids, STEPS)
        out[family.name] = (path, tokens, logits)
    return out


NAMES = [f.name for f in reference.FAMILIES]


def test_every_family_is_read_as_its_own_architecture(checkpoints):
    kinds = {name: LlamaConfig.load(checkpoints[name][0]) for name in NAMES}
    assert kinds["llama3.2"].rope_scaling is not None and kinds["llama3.2"].rope_scaling.rope_type == "llama3"
    assert kinds["llama3.2"].tie_word_embeddings
    assert kinds["qwen2"].qkv_bias and not kinds["qwen2"].o_bias
    assert kinds["qwen2"].sliding_layers == (3, 4, 5) and kinds["qwen2"].sliding_window == 8
    assert kinds["mistral"].window(0) == 8
    assert kinds["llama-bias"].o_bias and kinds["llama-bias"].mlp_bias
    assert (checkpoints["llama3.2"][0] / "model.safetensors.index.json").exists()


@pytest.mark.parametrize("name", NAMES)
def test_one_process_matches_transformers(checkpoints, name):
    path, want_tokens, want = checkpoints[name]
    got = generate(path, PROMPT, STEPS, return_logits=True)
    assert got["tokens"] == want_tokens
    assert reference.worst_error(got["logits"], want) <= TOLERANCE


@pytest.mark.parametrize("name", NAMES)
def test_three_stages_each_reading_its_share_match_transformers(checkpoints, name):
    """The stages' share of the tensors, chained the way the pipeline chains them."""
    path, want_tokens, want = checkpoints[name]
    config = LlamaConfig.load(path)
    ids = prompt_ids(load_tokenizer(path, config.bos_token_id, config.eos_token_ids), PROMPT)
    tokens, logits = reference.staged_greedy(path, ids, STEPS, stages=3)
    assert tokens == want_tokens
    assert reference.worst_error(logits, want) <= TOLERANCE


@pytest.mark.parametrize("name", NAMES)
async def test_a_three_stage_mesh_matches_transformers(checkpoints, name):
    path, want_tokens, want = checkpoints[name]
    lines: list[str] = []
    with trio.fail_after(90):
        async with trio.open_nursery() as nursery:
            nodes = await start_pipeline(nursery, path, 3, lines)
            got = await nodes[0].app.generate(PROMPT, STEPS, 0.0, 0, 0, want_logits=True)
            nursery.cancel_scope.cancel()
    assert got["tokens"] == want_tokens
    assert reference.worst_error(got["logits"], want) <= TOLERANCE


@pytest.mark.parametrize("name, off", [
    ("llama3.2", {"rope_scaling": None}),
    ("llama-bias", {"rope_scaling": None}),
    ("mistral", {"sliding_window": None}),
    ("qwen2", {"sliding_window": None}),
    ("qwen2", {"sliding_layers": None}),  # the window in every layer, not only 3..5
])
def test_each_family_feature_changes_the_logits(checkpoints, name, off):
    """The comparisons above would catch a feature read and then ignored: without it the
    logits leave the tolerance by far."""
    import dataclasses

    path, _, want = checkpoints[name]
    config = dataclasses.replace(LlamaConfig.load(path), **off)
    got = generate(path, PROMPT, len(want), return_logits=True, model=StageModel.load(path, config=config))
    assert got["logits"].shape != want.shape or reference.worst_error(got["logits"], want) > 100 * TOLERANCE


@pytest.mark.processes
def test_smoke_run_serves_a_sharded_bf16_llama_3_2_checkpoint_token_for_token(checkpoints, tmp_path):
    """The acceptance run: Llama 3.2's architecture (rope_scaling llama3, tied embeddings),
    saved by transformers in bfloat16 and in shards, through `meshd smoke-run --stages 3`:
    three stage processes, each reading its shards, equal to `meshd generate` and to
    transformers."""
    import json
    import os
    import subprocess
    import sys

    path = checkpoints["llama3.2"][0]
    assert len(list(path.glob("model-*-of-*.safetensors"))) > 3
    r = subprocess.run([sys.executable, "-m", "meshd", "smoke-run", "--json", "--model", str(path),
                        "--stages", "3", "--prompt", PROMPT, "--max-tokens", str(STEPS)],
                       capture_output=True, text=True, timeout=180,
                       env={**os.environ, "XDG_STATE_HOME": str(tmp_path / "state")})
    assert r.stdout.strip(), r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert r.returncode == 0 and out["ok"], json.dumps(out)
    assert out["matches_reference"] and out["tokens"] == out["reference_tokens"]
    assert out["tokens"] == checkpoints["llama3.2"][1]  # and transformers' greedy tokens
