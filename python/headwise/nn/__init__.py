"""nn.Modules built on the headwise ops."""

from .dcmha_attention import DCMHAttention
from .head_gate import HeadGate, L0Schedule
from .mhar_router import MHARRouter

__all__ = ["DCMHAttention", "HeadGate", "L0Schedule", "MHARRouter"]
