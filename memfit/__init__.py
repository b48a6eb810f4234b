"""memfit's shared core: what every stage (training, compress, serve) uses and no stage owns.

- ``memfit.errors``: ``UserError`` (exit 2 in the CLIs, an OpenAI error body over HTTP);
- ``memfit.modeldir``: the model directory (validated once, config read, written atomically, safetensors only);
- ``memfit.hf``: Hugging Face loading (no pickle, no remote code unless asked, no hub kernels) and NF4 settings;
- ``memfit.defaults``: the defaults several stages share (context length, calibration size, group size);
- ``memfit.runtime``: one Linear protocol over every weight format, memfit's CPU kernels and the slot-cache
  forward pass that serve runs and compress measures decode speed with.

This package imports no stage (``training``, ``compress``, ``serve``): tests/memfit/test_layers.py checks it.
"""

from memfit.errors import UserError

__all__ = ["UserError"]
