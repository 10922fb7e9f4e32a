"""A/B load testing of vLLM servers (`proxima bench`)."""
