"""The tutorial's attention concepts as objects: the eight steps, heads, multi-head, the worked example.

Not part of the engine's data path: these pieces explain attention and are built on the engine (the step
kernels, the dense reference and sparse attention).

The eight steps of attention, for inputs X and, for cross-attention, a context C
(:func:`attention_steps` keeps every intermediate in an :class:`AttentionSteps`):

1. prepare the inputs X (and C);
2. initialise the weights W_query, W_key, W_value;
3. queries Q = X W_query, keys K = C W_key, values V = C W_value (C = X for self-attention);
4. scores of query i against every key: q_i . k_j (times ``scale``);
5. softmax over those scores -> attention weights;
6. multiply each value v_j by its weight;
7. sum the weighted values -> output i;
8. repeat 4-7 for every query.

:class:`AttentionHead` is one (W_query, W_key, W_value) set; :class:`MultiHeadAttention` runs several,
concatenates the head outputs and applies an output projection W_out.  Both run dense (the exact
reference) or sparse (a SparsePattern, or a selector picking keys per head), as self- or cross-attention.
:func:`seed_example` is the worked example; its hand-worked numbers are in
:mod:`sparseattn.tutorial.example`.

>>> import sparseattn as sa
>>> e = sa.tutorial.seed_example()
>>> steps = sa.tutorial.attention_steps(e["X"], e["W_query"], e["W_key"], e["W_value"], scale=1.0)
>>> steps.outputs[0].round(6).tolist()
[1.936621, 6.683105, 1.595068]
"""

from .example import seed_example
from .layers import AttentionHead, MultiHeadAttention
from .steps import AttentionSteps, attention_steps

__all__ = ["AttentionHead", "AttentionSteps", "MultiHeadAttention", "attention_steps", "seed_example"]
