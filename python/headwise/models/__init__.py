"""Small decoder models built on headwise ops, for tests, the demo and benchmarks."""

from .decoder import Decoder, DecoderConfig

__all__ = ["Decoder", "DecoderConfig"]
