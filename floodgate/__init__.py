"""Floodgate: admission control and elastic scaling for LLM inference behind Envoy."""

__version__ = "0.1.0"
