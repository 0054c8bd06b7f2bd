"""The Batch API: ``/v1/files`` and ``/v1/batches`` as OpenAI defines them (docs/batch.md)."""
