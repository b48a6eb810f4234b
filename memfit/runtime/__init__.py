"""memfit's inference runtime, shared by compress (decode-speed measurement) and serve.

- ``linear``: the one Linear protocol and ``weight_format``, the one place that tells weight formats apart;
- ``dense`` (fp32 / int8 on the panel GEMM or oneDNN), ``int4`` (torch's CPU int4 pack on memfit's kernel),
  ``qlinear`` (a compress output's Linear), ``quantized`` (the format compress hands over), ``fuse``;
- ``kernels`` + ``csrc/``: memfit's C++ CPU kernels, compiled on first use for the CPU that runs them;
- ``slot_model``: the packed slot-cache forward pass; ``fast_stack``: its layers as one C++ call; ``kv_cache``:
  its KV tensors and block tables; ``kv_groups``: which layers share a block table (sliding windows);
  ``modules``: what it checks on an HF module; ``offload``: prefetching offloaded layers.
"""
