"""The dense store: flat fp32 buffers of the shard's chunks, the optimizer that steps them, and its optimizer state."""
