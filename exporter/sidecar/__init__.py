"""The sidecar: NVML GPU collector and sampled-quality prober (no torch needed)."""
