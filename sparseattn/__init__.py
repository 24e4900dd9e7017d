"""sparseattn."""
