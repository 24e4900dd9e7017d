"""Real Q/K/V capture from all-MiniLM-L6-v2: the public names of :mod:`sparseattn.tools.traces`.

The capture code lives with the other tools; this module keeps the documented import path
(``from sparseattn.traces import model_path``) working.
"""

from .tools.traces import (
    KJV_PACKAGES,
    MODEL_NAME,
    Capture,
    capture_qkv,
    clean_kjv,
    generate_traces,
    kjv_text,
    load_model,
    model_path,
    norm_profiles,
    tokenize_text,
    verify_capture,
    write_npz,
)

__all__ = [
    "Capture", "KJV_PACKAGES", "MODEL_NAME", "capture_qkv", "clean_kjv", "generate_traces", "kjv_text", "load_model",
    "model_path", "norm_profiles", "tokenize_text", "verify_capture", "write_npz",
]
