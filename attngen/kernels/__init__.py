"""Kernel families on the Python side: one module per family (forward; topk holds the forward
family's top-k threshold kernels), the shared launch helper (launch) and autograd (autograd)."""
