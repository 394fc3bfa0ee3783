"""Compute kernels. Importing this package compiles nothing: each kernel builds on first use."""
from ssd.kernels.linear_cpu import available as linear_available
from ssd.kernels.linear_cpu import linear

__all__ = ["linear", "linear_available"]
