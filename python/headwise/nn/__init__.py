"""nn.Modules built on the headwise ops."""

from .dcmha_attention import DCMHAttention
from .mhar_router import MHARRouter

__all__ = ["DCMHAttention", "MHARRouter"]
