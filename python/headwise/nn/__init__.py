"""nn.Modules built on the headwise ops."""

from .mhar_router import MHARRouter

__all__ = ["MHARRouter"]
