"""Quantized checkpoints: the quantization_config a checkpoint declares (scheme.py), the
one in-memory form of an integer weight (int_weight.py), each format's decoder into it
(formats/), and the linears that run it (the ops layer's quantized LinearMethods)."""
