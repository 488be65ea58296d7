"""adtopk-ps: a BytePS-style parameter server with ADTopk gradient sparsification."""

__version__ = "0.1.0"
