"""Stand-in for apex's fused_weight_gradient_mlp_cuda extension: importable (the probe only imports it)."""
