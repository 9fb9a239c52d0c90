"""Hugging Face export: a Keel checkpoint as a transformers model directory (`keel export`)."""
