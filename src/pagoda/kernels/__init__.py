"""Optional native kernels; each falls back to plain PyTorch where it cannot run."""
