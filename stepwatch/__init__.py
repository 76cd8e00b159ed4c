"""stepwatch: observability and incident triage for diffusion-model inference."""

__version__ = "0.1.0"
