"""Adapters: the one place each dependency's private internals are used (deepspeed_internals, torch_internals)."""
