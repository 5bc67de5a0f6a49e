"""The ops a model is bound to, once, at engine setup (`CausalLM.bind`).

A decoder layer is written once, against two small interfaces:
- `LayerOps` (layer_ops.py): the elementwise parts of a layer (RMSNorm, the residual add fused
  with the next norm, SiLU(gate) * up, rope in place, the greedy argmax), outputs first, so each
  op writes into a buffer of the step's `Workspace` (workspace.py). `LayerOps` itself is the
  torch implementation, which runs on any device and dtype; `CpuKernelLayerOps`
  (compiled_layer_ops.py) overrides the ops the C++ kernels serve.
- `LinearOp` (linear.py): y = x @ W.T + b, applied into a workspace buffer where the
  implementation can write one (`apply(x, out)`). A `LinearMethod` (linear_method.py) makes
  every linear's module once, from its spec and loaded tensors: a dense weight on torch (the
  weight as it is), oneDNN's prepacked layout (onednn_linear.py), the AVX512-BF16 kernel's
  (bf16_linear.py, which also fuses SiLU(gate) * up into the gate/up linear) or the float32
  kernel's (f32_linear.py); a quantized one on the C++ or Triton int kernels (int_linear.py,
  triton_int_linear.py), dequantized once (dequantized_linear.py), or torch's dequantize on
  every call (quant_linear.py).

select.py picks one implementation of each for an engine's device, dtype and options
(`select_model_ops`); the model never inspects which one it got.
"""
