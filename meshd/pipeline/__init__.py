"""Pipeline-parallel inference: a numpy Llama cut into stages, and its single-process reference."""

from .checkpoint import CheckpointError, init_checkpoint, load_weights
from .config import ConfigError, LlamaConfig
from .generate import generate
from .model import KVCache, StageModel, split_layers
from .sampling import Sampler
from .stub import stub_checkpoint, stub_model
from .tokenizer import ByteTokenizer, TokenizerError, load_tokenizer

__all__ = [
    "ByteTokenizer", "CheckpointError", "ConfigError", "KVCache", "LlamaConfig", "Sampler", "StageModel",
    "TokenizerError", "generate", "init_checkpoint", "load_tokenizer", "load_weights", "split_layers",
    "stub_checkpoint", "stub_model",
]
