"""Model building blocks: attention backends, rotary embeddings, normalization."""

__all__: list[str] = []
