"""The tutorial's worked example: three inputs, hand-picked weights, every intermediate worked out.

Inputs, one row of X (3, 4) each::

    input1 = [1, 0, 1, 0]
    input2 = [0, 2, 0, 2]
    input3 = [1, 1, 1, 1]

Weights (4, 3), given as if already trained::

    W_key   = [[0, 0, 1], [1, 1, 0], [0, 1, 0], [1, 1, 0]]
    W_query = [[1, 0, 1], [1, 0, 0], [0, 0, 1], [0, 1, 1]]
    W_value = [[0, 2, 0], [0, 3, 0], [1, 0, 3], [1, 1, 0]]

Worked by hand (the tutorial uses no ``1/sqrt(d)`` scaling here, i.e. ``scale = 1``)::

    K = X W_key   = [[0, 1, 1], [4, 4, 0], [2, 3, 1]]
    Q = X W_query = [[1, 0, 2], [2, 2, 2], [2, 1, 3]]
    V = X W_value = [[1, 2, 3], [2, 8, 0], [2, 6, 3]]
    scores = Q K^T = [[2, 4, 4], [4, 16, 12], [4, 12, 10]]
    softmax(scores row 1) = [0.063379, 0.468311, 0.468311]

    outputs with scale = 1:
      output1 = [1.936621, 6.683105, 1.595068]
      output2 = [1.999994, 7.963992, 0.053976]
      output3 = [1.999705, 7.759892, 0.358389]
    outputs with the usual scale = 1/sqrt(3):
      output1 = [1.863874, 6.319371, 1.704189]
      output2 = [1.999110, 7.814124, 0.273472]
      output3 = [1.992555, 7.479636, 0.735877]

The tutorial rounds softmax(row 1) to [0.0, 0.5, 0.5], which gives output1 = [2.0, 7.0, 1.5].
``tests/test_tutorial.py`` checks every number above against :func:`attention_steps`, the layers and the
engine's dense and sparse attention; ``sparseattn explain`` prints the eight steps for this example.

>>> import numpy as np
>>> from sparseattn.tutorial import attention_steps, seed_example
>>> e = seed_example()
>>> steps = attention_steps(e["X"], e["W_query"], e["W_key"], e["W_value"], scale=1.0)
>>> steps.scores.tolist()
[[2.0, 4.0, 4.0], [4.0, 16.0, 12.0], [4.0, 12.0, 10.0]]
>>> np.round(steps.weights[0], 6).tolist()
[0.063379, 0.468311, 0.468311]
>>> np.round(steps.outputs[0], 6).tolist()
[1.936621, 6.683105, 1.595068]
"""

from __future__ import annotations

import numpy as np

__all__ = ["seed_example"]


def seed_example() -> dict[str, np.ndarray]:
    """The worked example's inputs and weights (see the module docstring for the worked numbers).

    Returns
    -------
    dict of float64 arrays: ``"X"`` (3, 4), ``"W_key"``, ``"W_query"``, ``"W_value"`` (4, 3) each.
    With ``scale=1`` the attention output row 1 is [1.936621, 6.683105, 1.595068].
    """
    return {
        "X": np.array([[1, 0, 1, 0], [0, 2, 0, 2], [1, 1, 1, 1]], dtype=np.float64),
        "W_key": np.array([[0, 0, 1], [1, 1, 0], [0, 1, 0], [1, 1, 0]], dtype=np.float64),
        "W_query": np.array([[1, 0, 1], [1, 0, 0], [0, 0, 1], [0, 1, 1]], dtype=np.float64),
        "W_value": np.array([[0, 2, 0], [0, 3, 0], [1, 0, 3], [1, 1, 0]], dtype=np.float64),
    }
