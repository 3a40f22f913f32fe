"""Stand-in for a machine without apex's fused_weight_gradient_mlp_cuda: the import fails as a missing module's
does (Megatron-Core's tensor_parallel/layers.py catches ImportError)."""
raise ImportError("fused_weight_gradient_mlp_cuda (test stand-in: not installed)")
