"""Models: the shared decoder, the architecture registry, the checkpoint loader."""

from pagoda.models.base import CausalLM
from pagoda.models.config import ModelArchConfig
from pagoda.models.decoder import DecoderForCausalLM
from pagoda.models.hf_config import parse_hf_config, read_hf_config
from pagoda.models.loader import load_model
from pagoda.models.registry import ModelFamily, get_model_family, supported_architectures

__all__ = [
    "CausalLM",
    "DecoderForCausalLM",
    "ModelArchConfig",
    "ModelFamily",
    "get_model_family",
    "load_model",
    "parse_hf_config",
    "read_hf_config",
    "supported_architectures",
]
