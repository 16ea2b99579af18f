"""Small jobs that run the same under ``dtlib.spawn`` and ``torchrun``."""
